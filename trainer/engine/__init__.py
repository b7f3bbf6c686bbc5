"""The training step and what executes it: one replica's step (step.py), the all-reduce between
threaded replicas (allreduce.py), the compiled update (adamw.py), the first-step check (numerics.py),
worker threads (workers.py) and a torchrun rank (ranks.py), both an Engine (protocol.py: what the loop
calls). Imports the model and the run's types.
"""
