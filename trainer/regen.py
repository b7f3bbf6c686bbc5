"""`python -m trainer.regen`: training rows answered by the target itself (trainer/run/regen.py)."""
from trainer.cores import passive_waits

passive_waits()     # before torch loads OpenMP (trainer.run imports torch)
from trainer.exits import exit_process, run  # noqa: E402
from trainer.run.regen import main  # noqa: E402

if __name__ == "__main__":
    exit_process(run(main))
