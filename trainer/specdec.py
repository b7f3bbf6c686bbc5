"""`python -m trainer.specdec`: decoding with the drafter against the target alone, measured
(trainer/run/specdec.py)."""
from trainer.exits import exit_process, run
from trainer.run.specdec import main

if __name__ == "__main__":
    exit_process(run(main))
