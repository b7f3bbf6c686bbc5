"""`python -m trainer.eval`: the acceptance length of a run's drafter (trainer/run/acceptance.py)."""
from trainer.exits import exit_process, run
from trainer.run.acceptance import main

if __name__ == "__main__":
    exit_process(run(main))
