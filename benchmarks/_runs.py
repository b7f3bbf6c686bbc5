"""What the claims and fp8 scripts share: the runs a script of scripts/ left in one folder, each as
specdec-NAME.json (tau on the held-out prompts) and metrics-NAME.jsonl (training loss)."""
from __future__ import annotations

import json
from pathlib import Path


def load(folder: Path) -> tuple[dict, dict]:
    """{NAME: specdec document}, {NAME: [(step, loss)]} (the metric lines, events left out)."""
    docs = {p.stem[len("specdec-"):]: json.loads(p.read_text()) for p in sorted(folder.glob("specdec-*.json"))}
    curves = {}
    for p in sorted(folder.glob("metrics-*.jsonl")):
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        curves[p.stem[len("metrics-"):]] = [(r["step"], r["loss"]) for r in rows
                                            if "loss" in r and "step" in r and "event" not in r]
    return docs, curves
