"""`python -m trainer.eval`: the acceptance length of a run's drafter (trainer/run/eval.py)."""
import sys

from trainer.exits import run
from trainer.run.eval import main

if __name__ == "__main__":
    sys.exit(run(main))
