"""The drafter and its kernels: pure torch modules and functions, no files, no threads, no config.

drafter.py (the model and its config), linear.py (its Linear layers' gradient paths), attention.py,
masks.py, draft_loss.py (the training loss), fused_ce.py and ce_kernel.py (its cross-entropy).
"""
