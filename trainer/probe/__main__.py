"""`python -m trainer.probe`: see trainer/probe/program.py."""
from trainer.exits import exit_process
from trainer.probe.program import main

if __name__ == "__main__":
    exit_process(main())
