"""What each lever of a speculative decode is worth, from a run's saved documents.

    python benchmarks/decode_levers.py SPECDEC.json [--shapes SHAPES.json] [--json]

SPECDEC.json is `python -m trainer.specdec --json`'s document: its `model.costs_ms` (each step of the
round timed alone), its headline tau and the mean output length. The levers are the parts of a round
(trainer/run/decode_model.py): the speedup is predicted again with one part changed at a time, the
prompt's forward included, at the document's tau and mean output:

- the verify at the one-token step's cost (what a step bound by reading the weights gives: the 16
  tokens of a verify cost about one token's time, as at an 8B target);
- the drafter free (its draft and its extend of the context at no cost);
- the host free (the round's synchronisation and bookkeeping);
- all three together (the limit: tau itself);
- tau one token higher.

Each row also gives the tau that 2x would need with that change. --shapes adds, from
benchmarks/decode_shapes.py's document, the speedup the same tau predicts at that model's shape (the
tau carries over to a user's model; the speedup does not).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.errors import EXIT_USAGE, UsageError  # noqa: E402 (torch-free)
from trainer.run.decode_model import RoundCosts, speedup_at, tau_for  # noqa: E402 (torch-free)



def costs(ms: dict, where: str) -> RoundCosts:
    """RoundCosts in seconds from a document's costs in milliseconds."""
    try:
        c = RoundCosts.from_ms(ms)
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{where}: no costs of each part ({e}); a document of specdec --json since its "
                         f"`model` field, or of decode_shapes.py") from None
    if min(c.step, c.round) <= 0:
        raise UsageError(f"{where}: a step or a round that costs nothing")
    return c


def read(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        raise UsageError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: not a document (a JSON object)")
    return doc


def changed(c: RoundCosts, lever: str) -> RoundCosts:
    """The costs with one lever pulled; the round keeps its parts' sum plus its host share."""
    host = c.host
    draft, verify, extend = c.draft, c.verify, c.extend
    if lever in ("verify", "all"):
        verify = min(verify, c.step)
    if lever in ("drafter", "all"):
        draft = extend = 0.0
    if lever in ("host", "all"):
        host = 0.0
    return replace(c, draft=draft, verify=verify, extend=extend, round=draft + verify + extend + host)


LEVERS = (("as measured", None), ("verify at the one-token step's cost", "verify"),
          ("drafter free (draft and extend)", "drafter"), ("host free", "host"),
          ("all three (tau alone limits)", "all"))


def levers(c: RoundCosts, tau: float, new_tokens: int) -> list[dict]:
    rows = []
    for label, lever in LEVERS:
        cc = changed(c, lever) if lever else c
        rows.append({"lever": label, "round_ms": 1e3 * cc.round, "speedup": speedup_at(cc, tau, new_tokens),
                     "tau_for_2x": tau_for(cc, 2.0, new_tokens)})
    rows.append({"lever": "tau one token higher", "round_ms": 1e3 * c.round,
                 "speedup": speedup_at(c, tau + 1, new_tokens), "tau_for_2x": tau_for(c, 2.0, new_tokens)})
    return rows


def report(spec_path: str, shapes_path: str | None) -> dict:
    doc = read(spec_path)
    model = doc.get("model")
    if not isinstance(model, dict):
        raise UsageError(f"{spec_path}: no `model` field (specdec documents since 2026-12-05 have one)")
    c = costs(model.get("costs_ms") or {}, spec_path)
    tau, n = doc.get("tau"), model.get("new_tokens")
    if not isinstance(tau, (int, float)) or not isinstance(n, int) or tau < 1 or n < 1:
        raise UsageError(f"{spec_path}: no headline tau and mean output length")
    out = {"specdec": spec_path, "tau": tau, "new_tokens": n, "costs_ms": c.as_ms(),
           "measured_speedup": doc.get("speedup"), "levers": levers(c, tau, n)}
    if shapes_path:
        sd = read(shapes_path)
        sc = costs(sd.get("costs_ms") or {}, shapes_path)
        sn = sd.get("new_tokens") if isinstance(sd.get("new_tokens"), int) else n
        out["shape"] = {"file": shapes_path, "name": (sd.get("shape") or {}).get("name"), "new_tokens": sn,
                        "costs_ms": sc.as_ms(), "speedup_at_tau": speedup_at(sc, tau, sn),
                        "speedup_at_tau_long": speedup_at(sc, tau), "tau_for_2x": tau_for(sc, 2.0, sn)}
    return out


def render(r: dict) -> str:
    ms = r["costs_ms"]
    lines = [f"{r['specdec']}: tau {r['tau']:.2f}, {r['new_tokens']} new tokens a prompt on average; measured "
             f"{r['measured_speedup']:.2f}x",
             f"a round {ms['round']:.3f} ms = verify {ms['verify']:.3f} + draft {ms['draft']:.3f} + extend "
             f"{ms['extend']:.3f} + host {ms['host']:.3f}; the one-token step {ms['step']:.3f} ms "
             f"(verify / step {ms['verify'] / ms['step']:.2f})", "",
             f"{'lever':<38}{'round, ms':<11}{'speedup':<9}tau for 2x"]
    for row in r["levers"]:
        t = row["tau_for_2x"]
        lines.append(f"{row['lever']:<38}{row['round_ms']:<11.3f}{row['speedup']:<9.2f}"
                     f"{'unreachable' if t is None else f'{t:.2f}'}")
    s = r.get("shape")
    if s:
        lines += ["", f"at {s['name'] or 'the shape'} ({s['file']}): tau {r['tau']:.2f} predicts "
                  f"{s['speedup_at_tau']:.2f}x at {s['new_tokens']} new tokens ({s['speedup_at_tau_long']:.2f}x for "
                  f"long outputs); 2x needs tau {s['tau_for_2x']:.2f} there"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="decode_levers.py", description=__doc__.split("\n\n")[0])
    p.add_argument("specdec", metavar="SPECDEC.json")
    p.add_argument("--shapes", metavar="SHAPES.json", help="decode_shapes.py's document: the speedup there")
    p.add_argument("--json", action="store_true", help="the figures as one JSON document")
    a = p.parse_args(argv)
    try:
        r = report(a.specdec, a.shapes)
    except UsageError as e:
        print(f"decode_levers: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(r, indent=1) if a.json else render(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
