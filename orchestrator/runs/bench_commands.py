"""Click command `bench-decode`: decoding with a run's drafter against the target alone (thin: parse
options, call runs/bench_decode.py, show specdec's live lines on stderr and the summary line)."""
from __future__ import annotations

import click

from orchestrator.ui import State, emit, json_option, sigterm_raises


@click.command("bench-decode")
@click.argument("args", nargs=-1, metavar="[TARGET] [RUN]")
@click.option("--prompts", metavar="FILE",
              help="JSONL here (the spellings regen reads), checked, then sent to the target "
                   "(default: the prompts the run held out of its --data for its eval).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True, metavar="N",
              help="Tokens decoded per prompt, each way.")
@click.option("--limit", type=click.IntRange(min=1), metavar="N", help="Only the first N prompts.")
@click.option("--step", type=click.IntRange(min=0), metavar="N", help="The checkpoint of step N (default: the last).")
@click.option("--running-ok", is_flag=True, help="Measure a run that is still running (its newest checkpoint).")
@click.option("--target-changed-ok", is_flag=True,
              help="Measure although the target at the run's --target path is not the one it trained against "
                   "(same shapes; as export's).")
@click.option("--gpu", type=click.IntRange(min=0), metavar="ID",
              help="Measure on this GPU of the target (default: any free one; never the run's own).")
@click.option("--engine", type=click.Choice(["graphs", "eager"]), default="graphs", show_default=True,
              help="graphs: static KV caches, every step replayed as a CUDA graph, as serving engines decode (on "
                   "a CPU the same code runs uncaptured); eager: transformers' cache, kernels launched from Python.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="auto: bfloat16 on a GPU, float32 on a CPU. float32 requires every output to equal the "
                   "target's own (exit 1 otherwise); bfloat16 reports per prompt whether it is equal.")
@json_option
@click.pass_obj
def bench_decode(state: State, args, prompts, max_new_tokens, limit, step, running_ok, target_changed_ok, gpu,
                 engine, dtype, as_json):
    """Decode with a run's trained drafter against the target alone, on the target, and check the output is
    the target's own, token for token.

    RUN defaults to the target's newest succeeded run. It holds one free GPU of the target (its CPU
    slot on one without) while it measures, as a launch would; none free: exit 1. Prints tau and the
    speedup with their per-prompt bootstrap intervals, tokens/s of the target alone and with the
    drafter; exits 1 when a float32 output differs (bf16: reported per prompt, with the target's
    top-2 logit margin where they part).

    The measurement lives as long as this command: killed, timed out or cut off, it ends on the
    target within seconds; Ctrl-C or SIGTERM ends it there first (exit 130 / 143). Meanwhile
    `status` shows it as bench-PID and `stop TARGET bench-PID` ends it.
    """
    from orchestrator.runs import bench_decode as bench
    from orchestrator.runs import status as runs
    from orchestrator.runs import nodes
    from orchestrator.runs.logview import note

    target, run = runs.split_target_run(state.inv, args)
    with sigterm_raises(f"{target.name}: bench-decode"):     # SIGTERM too ends it on the target first
        if run != "latest":     # a run over several nodes: rank 0's node holds its checkpoints
            target = nodes.rank0_of(state.inv, target, run)
        doc = bench.bench_decode(state.inv, target, run, prompts=prompts, max_new_tokens=max_new_tokens,
                                 limit=limit, step=step, running_ok=running_ok, target_changed_ok=target_changed_ok,
                                 gpu=gpu, engine=engine, dtype=dtype,
                                 progress=None if as_json else lambda line: click.echo(line, err=True))
    emit(as_json, doc, bench.summary(doc))
    if doc["running"] and not as_json:
        note(f"{target.name}: run {doc['run']} is still running: this is its checkpoint of step {doc['step']}")
