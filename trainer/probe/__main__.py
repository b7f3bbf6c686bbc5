"""`python -m trainer.probe`: see trainer/probe/program.py."""
import sys

from trainer.probe.program import main

if __name__ == "__main__":
    sys.exit(main())
