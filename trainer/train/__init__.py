"""The training program: `main.py` is the linear main (config -> devices -> model -> workers -> loop),
`loop.py` the run's setup and step loop that threads and ranks share, `schedule.py` its learning
rate per step, `distributed.py` the torchrun launcher and a rank's main. The top of the trainer:
nothing below imports it.
"""


def train_entry(argv: list[str] | None = None) -> int:
    """`python -m trainer`: flags and config are checked before torch is imported (fast, one line)."""
    from trainer.run.flags import parse

    cfg = parse(argv)
    from trainer.run.trackers import check

    check(cfg.report_to)        # a tracker asked for and not installed: one line, exit 2, before any work
    from trainer.train.main import main

    return main(cfg)
