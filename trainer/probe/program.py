"""The probe: which compile policy works, and is fastest, for threaded training on THIS torch build.

    python -m trainer.probe [--threads N] [--steps K] [--timeout S] [--workdir DIR] [--jobs N]
                            [--expect JSON] [--policies a,b] [--signatures PATH]
                            [--precision fp8|fp8-rowwise|fp8-lmhead [--fp8-emulate]]

Runs on the target with only torch (+ PyYAML for the signature catalog). Prints ONE JSON document
on stdout; one progress line per case on stderr. It reports the build (python, torch, CUDA, cuDNN,
NCCL, Triton, driver, GPUs, bf16) against an optional expectation, the options of every compile
mode this torch knows, and the policy x topology matrix. Each case (case.py) runs the
trainer's own replica and engine at a small shape, in its OWN subprocess with a timeout, so a
segfault or a hang loses only that case (on a GPU host several at once, each timed alone, all
sharing one compile cache: schedule.py):
  threads    N worker threads as the trainer's ThreadEngine runs them (N = GPUs, at least 2);
  processes  a real DDP run under torchrun: 2 ranks on the CPU (gloo), one per GPU up to 2 (NCCL).
A case that runs is then judged against eager on identical weights and batches (gradients, not
only losses: numerics.py): `ok`, or `wrong` (signature compiled-wrong), which is never chosen.
The choice: the fastest `ok` policy in `threads` (eager when none passed: the document then names
the topology in `no_working_policy`, and `dflash-ops probe` exits 1); with --workdir it is
saved atomically in WORKDIR/probe.json, which `--compile-policy auto` reads (policies.resolve).
A second choice, `processes_policy`, answers `--topology processes` from the `processes` cases,
where CUDA-graph policies are allowed. `--precision fp8*` probes the trainer's fp8 path
instead (case.py: judged against eager bf16 within fp8's own measured noise); it reports, and keeps
its verdicts, but never writes probe.json, whose choice is the default path's.

This module is the parent: the matrix, each case's isolation, the choice, the saved result.
One case (`--case`) is case.py; the build report, build.py; cases side by side, schedule.py.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from trainer import cores, policies
from trainer.files import atomic_file
from trainer.probe.build import build_report, call_or_default, check_expect, mode_options
from trainer.probe.case import CPU_SHAPE, GPU_SHAPE, case_main
from trainer.probe import schedule, verdicts
from trainer.run.config import EMULATE_ALONE, PRECISIONS, TOPOLOGIES
from trainer.probe.case_watch import TAIL_LINES, explain, rendezvous_problem, run_isolated  # noqa: F401 - TAIL_LINES: tests

WRONG = "compiled-wrong"   # the signature of a case that ran but computes something else
HISTORY_KEEP = 20
# Two policies within this fraction of each other's step time are a tie on a noisy machine:
# the simpler one (earlier in POLICY_NAMES) wins.
TIE_MARGIN = 0.03
COST_ORDER = ("eager", "inductor", "reduce-overhead", "cudagraphs-no-trees", "max-autotune-no-cudagraphs",
              "test-drop-first-grad", "test-frozen")


class _Stopped(Exception):
    """SIGTERM reached the probe: finish with the cases done so far."""


def _stop_probe(signum, frame):
    raise _Stopped()


def _run_child(policy: str, topology: str, n: int, args, on_beat=None, control=None, env=None) -> dict:
    """One case: `python -m trainer.probe --case POLICY:TOPOLOGY:N` in the release's root; under
    `processes`, N ranks of it started by torchrun (`python -m torch.distributed.run`). `env`: what
    every case shares (schedule.compile_caches); `control`: its place in the schedule."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding trainer/
    # faulthandler prints "Fatal Python error: Segmentation fault" and every thread's stack
    env = dict(os.environ, **(env or {}), **(control.env() if control else {}), PYTHONUNBUFFERED="1",
               PYTHONFAULTHANDLER="1", PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    case = ["-m", "trainer.probe", "--case", f"{policy}:{topology}:{n}", "--steps", str(args.steps),
            "--device", args.device, "--timeout", str(args.timeout), "--precision", args.precision]
    case += ["--fp8-emulate"] if args.fp8_emulate else []
    if topology == "processes":
        if args.device != "cuda" and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, cores.cores() // n))   # the ranks share the cores
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
               f"--nproc-per-node={n}", *case]
    else:
        cmd = [sys.executable, *case]
    return run_isolated(cmd, args.timeout, cwd=root, env=env, on_beat=on_beat, control=control)


def processes_ranks(device: str, n_gpus: int) -> int:
    """Ranks of the `processes` cases: 2 on the CPU (gloo); on GPUs one per GPU, at most 2 (NCCL)."""
    return 2 if device != "cuda" else max(1, min(2, n_gpus))


def _case_record(policy, topology, n, run, catalog) -> dict:
    res, code = run["result"], run["exit_code"]
    if run["timed_out"]:
        outcome = "timeout"
    elif code is not None and (code < 0 or code > 128):
        outcome = "crashed"            # even after reporting: dying by a signal is the news
    elif res and res.get("ok"):
        outcome = "wrong" if res.get("wrong") else "ok"
    else:
        outcome = "failed"
    sig = None
    if outcome == "wrong":
        sig = WRONG
    elif outcome != "ok" and catalog is not None:
        sig = catalog.classify(run["output"], code)
    ran = outcome in ("ok", "wrong")
    why = explain(run["output"], sig, catalog) if outcome in ("failed", "crashed", "timeout") else {}
    num = (res or {}).get("numerics") or {}
    return {
        "policy": policy, "topology": topology, "threads": n, "outcome": outcome, "signature": sig,
        "step_ms": res.get("step_ms") if ran else None,
        "agrees": (outcome == "ok") if ran else None,
        "grad_err": num.get("grad_err"), "grad_tol": num.get("grad_tol"), "grad_noise": num.get("grad_noise"),
        "max_abs_diff": num.get("loss_err"), "numerics": num or None,
        "exit_code": code, "seconds": run["seconds"],
        "error": None if outcome == "ok" else ((res or {}).get("why") or (res or {}).get("error")
                                               or (run["tail"][-1] if run["tail"] else None)),
        "first_step_s": res.get("first_step_s") if ran else None,
        "eager_step_ms": res.get("eager_step_ms") if ran else None,
        "backends": res.get("backends") if ran else None,
        "caches": res.get("caches") if ran else None,
        "exception": why.get("exception"), "remedy": why.get("remedy"), "missing_module": why.get("missing_module"),
        "phase": run.get("phase"), "tail": run["tail"],
    }


def _skipped(policy, topology, n, why) -> dict:
    return {"policy": policy, "topology": topology, "threads": n, "outcome": "skipped",
            "signature": None, "step_ms": None, "agrees": None, "grad_err": None, "grad_tol": None,
            "grad_noise": None, "max_abs_diff": None, "numerics": None,
            "exit_code": None, "seconds": 0.0, "error": why, "exception": None, "remedy": None,
            "missing_module": None, "phase": None, "tail": []}


def _passed(cases: list[dict], topology: str) -> list[dict]:
    """Cases that ran and computed what eager computes (`wrong` is never chosen)."""
    return [c for c in cases if c["topology"] == topology and c["outcome"] == "ok" and c["step_ms"] is not None]


def choose(cases: list[dict]) -> tuple[str, str]:
    """The fastest policy that ran in `threads` and computes what eager computes; when none did, eager
    with a reason that says so."""
    passed = _passed(cases, "threads")
    failed = [f"{c['policy']} ({c['signature'] or c['outcome']})" for c in cases
              if c["topology"] == "threads" and c["outcome"] in ("failed", "crashed", "timeout")]
    wrong = [c["policy"] for c in cases if c["topology"] == "threads" and c["outcome"] == "wrong"]
    notes = ""
    if failed:
        notes += f"; failed in threads: {', '.join(failed)}"
    if wrong:
        notes += f"; ran but computed a different gradient than eager ({WRONG}): {', '.join(wrong)}"
    if not passed:
        return "eager", _none_works(cases, "threads") + notes
    passed.sort(key=lambda c: c["step_ms"])
    best = _fastest_or_simpler(passed)
    others = ", ".join(f"{c['policy']} {c['step_ms']:.2f}" for c in passed if c is not best)
    reason = (f"{best['policy']}: fastest of {len(passed)} polic{'y' if len(passed) == 1 else 'ies'} "
              f"that ran in {best['threads']} threads and matched eager's gradients "
              f"({best['step_ms']:.2f} ms/step" + (f"; {others} ms/step" if others else "") + ")")
    if best is not passed[0]:
        reason += f" (within {TIE_MARGIN:.0%} of {passed[0]['policy']}: the simpler policy wins)"
    return best["policy"], reason + notes


def _none_works(cases: list[dict], topology: str) -> str:
    """The reason when no policy passed in `topology`: eager is what `auto` then runs, named as a
    policy that failed when it did, never as a fallback that works."""
    eager = [c for c in cases if c["topology"] == topology and c["policy"] == "eager"]
    how = (f"eager {eager[0]['outcome']}" + (f" ({eager[0].get('error')})" if eager[0]["outcome"] == "skipped" else "")
           if eager else "eager not probed")
    return f"NO WORKING POLICY in {topology}: no policy ran and matched eager ({how}); `auto` would run eager"


def no_working_policy(cases: list[dict], topologies) -> list[str]:
    """The probed topologies where no policy passed (the probe command then exits 1, naming them)."""
    return [t for t in topologies if not _passed(cases, t)]


def _fastest_or_simpler(passed: list[dict]) -> dict:
    """The fastest case, unless a simpler policy (earlier in POLICY_NAMES) is within the noise margin."""
    order = {name: i for i, name in enumerate(policies.known())}
    fastest = min(passed, key=lambda c: c["step_ms"])
    return min((c for c in passed if c["step_ms"] <= fastest["step_ms"] * (1 + TIE_MARGIN)),
               key=lambda c: order.get(c["policy"], 99))


def choose_processes(cases: list[dict]) -> tuple[str, str]:
    """The policy for `--topology processes`, from the `processes` cases (a real DDP run), CUDA-graph
    policies included (the thread-local cudagraph-tree state that breaks them in worker threads is
    not shared across processes)."""
    passed = _passed(cases, "processes")
    wrong = [c["policy"] for c in cases if c["topology"] == "processes" and c["outcome"] == "wrong"]
    note = f"; ran but computed a different gradient than eager ({WRONG}): {', '.join(wrong)}" if wrong else ""
    if not passed:
        return "eager", _none_works(cases, "processes") + note
    best = _fastest_or_simpler(passed)
    graphs = [c["policy"] for c in passed if policies.needs_cuda(c["policy"])]
    reason = (f"{best['policy']}: fastest of {len(passed)} that ran as {best['threads']} DDP rank(s) "
              f"and matched eager's gradients ({best['step_ms']:.2f} ms/step)")
    if graphs:
        reason += f"; CUDA-graph policies allowed with one process per GPU: {', '.join(graphs)}"
    return best["policy"], reason + note


def save_result(workdir: str, doc: dict) -> str:
    """Write WORKDIR/probe.json atomically (temp file + rename), keeping the last runs' summaries."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, policies.PROBE_FILE)
    history = []
    prev = call_or_default(lambda: json.loads(Path(path).read_text(encoding="utf-8")))
    if isinstance(prev, dict):
        history = list(prev.get("history") or [])
        history.append({k: prev.get(k) for k in ("policy", "reason", "time", "torch")})
    record = {"policy": doc["policy"], "reason": doc["reason"], "time": doc["time"],
              "processes_policy": doc.get("processes_policy"),
              "torch": doc["torch"]["version"], "result": doc, "history": history[-HISTORY_KEEP:]}
    with atomic_file(path) as f:
        json.dump(record, f, indent=1)
    return path


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2g}"


def _progress(msg: str) -> None:
    sys.stderr.write(f"probe: {msg}\n")
    sys.stderr.flush()


def _said(label: str, case: dict) -> dict:
    """Print a case's end line (outcome, figures or what failed and how to fix it); return the case."""
    if case["outcome"] in ("ok", "wrong"):
        detail = (f"{case['step_ms']:.2f} ms/step, gradient vs eager {_fmt(case['grad_err'])} "
                  f"(tolerance {_fmt(case['grad_tol'])})")
        if case["outcome"] == "wrong":
            detail += f" [{WRONG}] {case['error']}"
    else:
        detail = case["signature"] or case["error"] or ""
        if case["outcome"] != "skipped":
            detail += (f" in phase {case['phase']}" if case.get("phase") else "") + "".join(
                f"\n    {k}: {case[k]}" for k in ("exception", "remedy") if case.get(k))
    _progress(f"{label}: {case['outcome']} {detail} ({case['seconds']:.1f} s)")
    return case


def default_jobs(cuda: bool, cores: int) -> int:
    """Cases side by side: one on a CPU (its cases use every core, and time on them); on a GPU host,
    one per 3 cores, at most 5 (a case traces and lowers on one core, its compile workers burst on a few
    more; the probe's small shapes leave the GPU's memory mostly free)."""
    return max(1, min(5, cores // 3)) if cuda else 1


def args_jobs(args, cuda: bool) -> int:
    return getattr(args, "jobs", None) or default_jobs(cuda, cores.cores())


def run_probe(args) -> dict:
    t_start = time.monotonic()
    build = build_report()
    cuda = args.device == "cuda"
    n_threads = args.threads or max(2, len(build["gpus"]))
    names = args.policies
    catalog, catalog_error = None, None
    try:
        from trainer.signatures import load_catalog
        catalog = load_catalog(args.signatures)
    except Exception as e:  # noqa: BLE001 - probe still runs; cases are just not named
        catalog_error = f"{type(e).__name__}: {e}"
    # Cheapest compiles first: a probe stopped early (SIGTERM, a caller's time limit) still has
    # the answers that matter; max-autotune benchmarks kernels for minutes on a cold cache.
    names = sorted(names, key=COST_ORDER.index)
    ranks = processes_ranks(args.device, len(build["gpus"]))
    plan = [(p, t, ranks if t == "processes" else n_threads) for p in names for t in args.topologies]
    _progress(f"torch {build['torch']}, {args.device}, {len(build['gpus'])} GPU(s); "
              f"{len(plan)} cases, threads={n_threads}")
    labels = [f"[{i}/{len(plan)}] {p} {t} x{n}" for i, (p, t, n) in enumerate(plan, 1)]
    cases: list = [None] * len(plan)
    rendezvous = rendezvous_problem() if "processes" in args.topologies else None   # a quick local check
    kept_in = None if args.fresh else verdicts.cache_dir(args.workdir)
    store_in = verdicts.cache_dir(args.workdir)
    base = verdicts.base_key(build, args.device, args.steps)
    if args.precision != "bf16":
        base = dict(base, precision=args.precision, fp8_emulate=args.fp8_emulate)
    keys = [verdicts.case_key(base, p, t, n) for p, t, n in plan]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    to_run = []
    for i, (policy, topology, n) in enumerate(plan):
        kept = verdicts.load(kept_in, keys[i])
        if kept is not None:
            cases[i] = kept
            _progress(f"{labels[i]}: {kept['outcome']} (reused: the verdict of {kept['reused']} for this torch, "
                      f"hardware and trainer source; --fresh runs it again)")
        elif policies.needs_cuda(policy) and not cuda:
            cases[i] = _said(labels[i], _skipped(policy, topology, n, "needs CUDA; this machine has none"))
        elif topology == "processes" and rendezvous:
            cases[i] = _said(labels[i], _skipped(policy, topology, n, f"rendezvous cannot form: {rendezvous}"))
        else:
            to_run.append(i)
    jobs = max(1, min(args_jobs(args, cuda), len(to_run) or 1))
    if jobs > 1:
        _progress(f"{len(to_run)} cases, {jobs} at a time; each one's timed phase alone (the others stopped)")

    def run_one(i: int, control) -> dict:
        policy, topology, n = plan[i]
        _progress(f"{labels[i]}: starting")

        def beat(phase: str, seconds: float) -> None:
            _progress(f"{labels[i]}: running, {phase} ({seconds:.0f} s)")

        case = _case_record(policy, topology, n, _run_child(policy, topology, n, args, beat, control, shared), catalog)
        if control.turns is not None:
            case["schedule"] = control.record()
        return case if control.halted else _said(labels[i], case)

    interrupted, stopped = False, []
    previous = signal.signal(signal.SIGTERM, _stop_probe)
    with schedule.compile_caches(args.workdir) as shared:
        try:
            ran = schedule.run_all(schedule.run_order(to_run, plan, jobs, COST_ORDER), jobs, run_one, t_start,
                                   name=lambda i: labels[i].split(" ", 1)[1])
        except schedule.Interrupted as e:
            # SIGTERM: report what is known rather than nothing (the cases so far cost minutes).
            interrupted, ran, stopped = True, e.results, e.stopped
    signal.signal(signal.SIGTERM, previous)
    for i, case in ran.items():
        if i not in stopped:
            cases[i] = case
            verdicts.store(store_in, keys[i], case, now)
    for i in to_run:
        if cases[i] is None:
            p, t, n = plan[i]
            cases[i] = (dict(_skipped(p, t, n, "the probe was stopped during this case"), outcome="timeout")
                        if i in stopped else _skipped(p, t, n, "not run: the probe was stopped"))
    policy, reason = choose(cases)
    if interrupted:
        reason += " (probe stopped early: later cases not run)"
    _progress(f"chosen: {reason}")
    processes_policy, processes_reason = (choose_processes(cases) if "processes" in args.topologies else
                                          (None, "not probed (--topologies threads)"))
    _progress(f"for --topology processes: {processes_reason}")
    shape = GPU_SHAPE if cuda else CPU_SHAPE
    doc = {
        "ok": True, "build": build,
        "torch": {"version": build["torch"], "cuda": build["cuda"], "gpus": [g["name"] for g in build["gpus"]]},
        "expect": check_expect(build, args.expect or {}),
        "modes": mode_options(),
        "device": args.device, "threads": n_threads, "steps": args.steps,
        "ranks": ranks, "jobs": jobs, "model": asdict(shape),
        "dtype": "bfloat16" if cuda and build["bf16"] else "float32",
        "policies": {p: policies.describe(p) for p in names},
        "cases": cases, "policy": policy, "reason": reason, "interrupted": interrupted,
        "processes_policy": processes_policy, "processes_reason": processes_reason,
        "no_working_policy": no_working_policy(cases, args.topologies),
        "reused_cases": [f"{c['policy']} {c['topology']}" for c in cases if c.get("reused")],
        "catalog_error": catalog_error,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.monotonic() - t_start, 2),
        "saved": None, "precision": args.precision,
    }
    if args.workdir and args.precision == "bf16":
        doc["saved"] = os.path.join(args.workdir, policies.PROBE_FILE)
        save_result(args.workdir, doc)
    return doc


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trainer.probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=0,
                    help="worker threads for the `threads` topology (default: number of GPUs, at least 2)")
    ap.add_argument("--steps", type=int, default=10,
                    help="timed training steps per case, after its numerics checks (default 10)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per case (default 600 on CUDA, 300 on CPU)")
    ap.add_argument("--workdir", help="save the choice in WORKDIR/probe.json (read by --compile-policy auto)")
    ap.add_argument("--expect", type=_json_object, default=None,
                    help='JSON expectation, e.g. \'{"torch": ">=2.5", "cuda": "13.0", "gpus": 8}\'')
    ap.add_argument("--policies", help=f"comma-separated subset of {','.join(policies.POLICY_NAMES)} (default: "
                                       f"{','.join(policies.PROBED_BY_DEFAULT)}; max-autotune's first compile "
                                       "takes minutes, so it is probed only when named)")
    ap.add_argument("--topologies", help=f"comma-separated subset of {','.join(TOPOLOGIES)} (default: both on "
                                         "CUDA, threads on a CPU-only machine; threads alone skips the DDP cases)")
    ap.add_argument("--fresh", action="store_true",
                    help="run every case again instead of reusing kept verdicts (verdicts.py: the cache and its key)")
    ap.add_argument("--jobs", type=int, default=0,
                    help="cases run side by side, each timed alone (default: 1 on a CPU; on a GPU host one per "
                         "3 cores, at most 5)")
    ap.add_argument("--signatures", help="signature catalog (default: the bundled signatures.yaml)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where cases run (default: cuda when available)")
    ap.add_argument("--precision", choices=PRECISIONS, default="bf16",
                    help="the drafter's matmuls, as the trainer's --precision (fp8*: reported, not saved)")
    ap.add_argument("--fp8-emulate", action="store_true", help="as the trainer's --fp8-emulate (CPU, tests)")
    ap.add_argument("--case", help=argparse.SUPPRESS)   # internal: POLICY:TOPOLOGY:N, one case
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.steps < 1 or args.threads < 0 or args.jobs < 0:
        _parser().error("--steps must be >= 1, --threads and --jobs >= 0")
    try:
        args.policies = policies.chosen(args.policies)
    except ValueError as e:
        _parser().error(str(e))
    tops = [t.strip() for t in (args.topologies or "").split(",") if t.strip()]
    if any(t not in TOPOLOGIES for t in tops) or ("threads" not in tops and tops):
        _parser().error(f"--topologies: a subset of {', '.join(TOPOLOGIES)} that includes threads "
                        f"(the choice for `launch` comes from it)")
    # On a CPU-only machine the trainer's default topology is threads; DDP over gloo there is slow to
    # probe and is what nobody launches by default, so it is probed only when asked for.
    args.topologies = tops or (list(TOPOLOGIES) if args.device == "cuda" else ["threads"])
    if args.precision != "bf16":
        from trainer.model import fp8

        why = fp8.refusal(torch.device(args.device), args.fp8_emulate)
        if why:
            _parser().error(f"--precision {args.precision}: {why}")
    elif args.fp8_emulate:
        _parser().error(EMULATE_ALONE)
    if args.timeout is None:
        # a GPU case compiles Triton kernels (max-autotune benchmarks them) in N threads at once
        args.timeout = 600.0 if args.device == "cuda" else 300.0
    if args.case:
        return case_main(args)
    doc = run_probe(args)
    sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    sys.stdout.flush()
    return 0

