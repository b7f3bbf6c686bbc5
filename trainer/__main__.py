"""`python -m trainer`: train a DFlash drafter (see trainer/train.py)."""
import sys

from trainer.cli import run, train_entry

sys.exit(run(train_entry))
