"""`python -m trainer.regen`: training rows answered by the target itself (trainer/run/regen.py)."""
import sys

from trainer.exits import run
from trainer.run.regen import main

if __name__ == "__main__":
    sys.exit(run(main))
