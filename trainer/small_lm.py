"""`python -m trainer.small_lm`: the small real target: a code LM trained on the standard library
(trainer/run/small_target.py)."""
from trainer.cores import passive_waits

passive_waits()     # before torch loads OpenMP (trainer.run imports torch)
from trainer.exits import exit_process, run  # noqa: E402
from trainer.run.small_target import main  # noqa: E402

if __name__ == "__main__":
    exit_process(run(main))
