"""What a training run is made of and leaves behind: its config (config.py, torch-free), tokenizer,
data, target model, checkpoints, metrics log, and the programs that read a finished run (eval.py,
export.py). Imports the model, never the engine. This file imports nothing.
"""
