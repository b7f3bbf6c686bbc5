"""Click command probe (thin: parse options, call probe.run, print a table per target)."""
from __future__ import annotations

import click

from trainer.controller_view import POLICY_NAMES, PRECISIONS   # the trainer's names (torch-free)

from orchestrator.errors import TargetsFailed
from orchestrator.ui import State, emit, json_option, table


def _policy_list(ctx, param, value: str | None) -> str | None:
    """--policies A,B: known names only, refused before anything connects."""
    if value is None:
        return None
    names = [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in POLICY_NAMES]
    if bad or not names:
        raise click.BadParameter(f"{', '.join(bad) or repr(value)}: not a policy "
                                 f"(choose from {', '.join(POLICY_NAMES)})")
    return ",".join(names)


@click.command()
@click.argument("names", nargs=-1, metavar="[TARGET...]")
@click.option("--gpus", type=click.IntRange(min=1),
              help="Worker threads to test (default: the target's gpus, at least 2).")
@click.option("--policies", metavar="A,B", callback=_policy_list,
              help="Only these policies (default: all but max-autotune-no-cudagraphs, whose "
                   "first compile takes minutes).")
@click.option("--case-timeout", type=click.IntRange(min=10),
              help="Seconds before one case counts as hung (default: 600 on CUDA, 300 on CPU).")
@click.option("--topologies", type=click.Choice(["threads", "threads,processes"]),
              help="threads: skip the DDP cases (default: both on a target with GPUs, threads on a CPU-only one).")
@click.option("--fresh", is_flag=True,
              help="Run every case again instead of reusing the verdicts kept on the target for this torch, "
                   "hardware and trainer source.")
@click.option("--reuse", is_flag=True,
              help="Keep the saved result (WORKDIR/probe.json) when the torch installed now made it.")
@click.option("--precision", type=click.Choice(PRECISIONS), default="bf16", show_default=True,
              help="The drafter's matmuls, as the trainer's --precision: fp8* probes the trainer's fp8 path "
                   "(judged against eager bf16 within fp8's own noise; reported, never saved as the choice; "
                   "needs torchao and FP8 tensor cores on the target).")
@click.option("--fp8-emulate", is_flag=True,
              help="With --precision fp8*: fp8's rounding without FP8 hardware (a CPU target; slow).")
@json_option
@click.pass_obj
def probe(state: State, names, gpus, policies, case_timeout, topologies, fresh, reuse, precision, fp8_emulate,
          as_json):
    """Verify the PyTorch build and find, by experiment, the compile policy for threaded training."""
    from orchestrator.probe import prober as probe_mod

    def live(target: str, line: str) -> None:
        click.echo(f"[{target}] {line}", err=True)

    matrix = probe_mod.Matrix(policies=tuple(policies.split(",")) if policies else (),
                              topologies=tuple(topologies.split(",")) if topologies else (),
                              case_timeout=case_timeout, fresh=fresh, precision=precision, fp8_emulate=fp8_emulate,
                              reuse=reuse)
    doc = probe_mod.probe(state.inv, list(names), matrix, gpus=gpus, on_line=live)
    blocks = []
    for name, res in doc["targets"].items():
        if not res.get("ok"):
            blocks.append(f"{name}: could not probe: {res.get('error')}")
            continue
        tv = res.get("torch", {})
        head = (f"{name}: torch {tv.get('version')} cuda {tv.get('cuda') or '-'} "
                f"gpus {len(tv.get('gpus') or [])} {', '.join(sorted(set(tv.get('gpus') or [])))}".rstrip()
                + (f" (the saved result of {res['reused']}, reused)" if res.get("reused") else "")
                + (f"; verdicts reused: {', '.join(res['reused_cases'])}" if res.get("reused_cases") else "")
                + (f"; precision {res['precision']}: reported, not saved (--policy auto reads the bf16 probe's "
                   f"choice)" if res.get("precision", "bf16") != "bf16" else ""))
        mismatches = (res.get("expect") or {}).get("mismatches") or []
        rows = [[c["policy"], c["topology"], c["threads"], c["outcome"],
                 f"{c['step_ms']:.1f}" if c.get("step_ms") is not None else None,
                 _grad_cell(c), c.get("signature")]
                for c in res.get("cases", [])]
        wrong = [f"  WRONG: {c['policy']} {c['topology']}: {c.get('error')}"
                 for c in res.get("cases", []) if c.get("outcome") == "wrong"]
        blocks.append("\n".join([head, *(f"  MISMATCH: {m}" for m in mismatches),
                                 table(["POLICY", "TOPOLOGY", "N", "OUTCOME", "STEP_MS",
                                        "GRAD_ERR/TOL", "SIGNATURE"], rows), *wrong,
                                 f"chosen policy: {res.get('policy')} ({res.get('reason', '')})",
                                 *([f"for --topology processes: {res['processes_policy']} "
                                    f"({res.get('processes_reason', '')})"]
                                   if res.get("processes_policy") else [])]))
    emit(as_json, doc, "\n\n".join(blocks))
    failed = {n: r.get("error") for n, r in doc["targets"].items() if not r.get("ok")}
    # exit 1 also when a probed topology has no working policy (`auto` there would run a policy that failed)
    failed.update({n: f"no working policy in {', '.join(r['no_working_policy'])}" for n, r in doc["targets"].items()
                   if r.get("ok") and r.get("no_working_policy")})
    if failed:
        raise TargetsFailed(failed)


def _grad_cell(case: dict) -> str | None:
    """The gradient error against eager and the case's noise-derived tolerance, e.g. `3.1e-07/3e-06`."""
    err, tol = case.get("grad_err"), case.get("grad_tol")
    if err is None and tol is None:
        return None
    return f"{'-' if err is None else f'{err:.2g}'}/{'-' if tol is None else f'{tol:.2g}'}"

