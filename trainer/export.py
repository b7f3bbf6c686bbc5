"""`python -m trainer.export`: a run's drafter in the upstream DFlash format (trainer/run/export.py)."""
from trainer.exits import exit_process, run
from trainer.run.export import main

if __name__ == "__main__":
    exit_process(run(main))
