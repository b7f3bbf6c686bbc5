"""`regen`: the target model's own answers to a prompts file, as a detached run.

A regen run is a run of kind `regen` (LaunchOptions.kind): the same launch as a training run
(nodes.launch -> the runs agent's launch: slots, supervisor, exit.json; `logs`, `status`, `stop`,
`launch --resume` work on it), with the prompts file checked here, before anything connects,
sent with the launch into the run's folder, and `python -m trainer.regen` started there instead
of the trainer. Its rows land in RUNDIR/regen.jsonl (the launch's `output`), the trainer's
`--data`.

Library functions: they return data or raise OpsError; never print.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

from orchestrator.errors import UsageError
from orchestrator.remote.runs.kinds import REGEN_PROMPTS as PROMPTS   # the name the runs agent reads
from orchestrator.runs.options import LaunchOptions, upload


def check_prompts(path: str) -> int:
    """The rows of a prompts file, each checked as `python -m trainer.regen` reads it (torch-free);
    bad input is a UsageError of one line naming file:line."""
    from trainer.controller_view import UsageError as BadRows, count_prompts

    try:
        return count_prompts(path)      # streamed: a million rows in the memory of one
    except BadRows as e:
        raise UsageError(str(e)) from None


def regen_options(*, prompts: str, model: str, gpus: int | None = None, gpu_ids: str | None = None,
                  max_new_tokens: int | None = None, batch_size: int | None = None,
                  temperature: float | None = None, thinking: bool = False, seed: int | None = None,
                  name: str | None = None, extra: Sequence[str] = (),
                  env: Mapping[str, str] | None = None) -> tuple[LaunchOptions, int]:
    """(the launch options of a regen run, the number of prompt rows). Options left None are
    trainer.regen's defaults; `extra` goes to it as is."""
    rows = check_prompts(prompts)
    args = ["--target", model]
    for flag, value in (("--max-new-tokens", max_new_tokens), ("--batch-size", batch_size),
                        ("--temperature", temperature), ("--seed", seed)):
        if value is not None:
            args += [flag, str(value)]
    if thinking:
        args.append("--thinking")
    opts = LaunchOptions.build(gpus=gpus, gpu_ids=gpu_ids, extra=[*args, *extra], name=name, env=env)
    path = str(Path(prompts).expanduser().resolve())
    return replace(opts, kind="regen", uploads=(upload(PROMPTS, path),)), rows


__all__ = ["regen_options", "check_prompts", "PROMPTS"]
