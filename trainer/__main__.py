"""`python -m trainer`: train a DFlash drafter (see trainer/train/main.py)."""
from trainer.exits import exit_process, run
from trainer.train import train_entry

if __name__ == "__main__":
    exit_process(run(train_entry))
