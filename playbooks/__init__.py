"""Remote steps as data: shell scripts that take their parameters as positional arguments.

A script is never edited to insert a value: `argv(NAME, *params)` gives
`["bash", "-c", SCRIPT, NAME, *params]`, and the transport quotes that argv once
(`orchestrator.transport.shell_join`). The steps that need more than a shell line are programs
of their own (`orchestrator/remote/*.py`, `python -m trainer.probe`).
"""
from __future__ import annotations

from importlib import resources


def script(name: str) -> str:
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def argv(name: str, *params: str) -> list[str]:
    return ["bash", "-c", script(name), name, *params]
