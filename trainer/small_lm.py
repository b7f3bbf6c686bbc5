"""`python -m trainer.small_lm`: the small real target: a code LM trained on the standard library
(trainer/run/small_lm.py)."""
from trainer.exits import exit_process, run
from trainer.run.small_lm import main

if __name__ == "__main__":
    exit_process(run(main))
