"""`python -m trainer.regen`: training rows answered by the target itself (trainer/run/regen.py)."""
from trainer.exits import exit_process, run
from trainer.run.regen import main

if __name__ == "__main__":
    exit_process(run(main))
