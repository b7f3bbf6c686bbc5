"""`python -m trainer.probe`: see trainer/probe/program.py."""
import sys

from trainer.probe.program import main

sys.exit(main())
