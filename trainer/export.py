"""`python -m trainer.export`: a run's drafter in the upstream DFlash format (trainer/run/export.py)."""
import sys

from trainer.exits import run
from trainer.run.export import main

if __name__ == "__main__":
    sys.exit(run(main))
