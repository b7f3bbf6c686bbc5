"""`python -m trainer`: train a DFlash drafter (see trainer/train.py)."""
from trainer.cli import leave, run, train_entry

leave(run(train_entry))
