"""`python -m trainer.specdec`: decoding with the drafter against the target alone, measured
(trainer/run/specdec.py)."""
import sys

from trainer.exits import run
from trainer.run.specdec import main

if __name__ == "__main__":
    sys.exit(run(main))
