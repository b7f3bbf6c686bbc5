"""Click command `regen`: the target model answers a prompts file, as a detached run (thin: parse
options, build them with runs/regen.py, launch through nodes.launch, print the run id as `launch` does)."""
from __future__ import annotations

import click

from orchestrator.errors import UsageError
from orchestrator.runs.run_commands import (PassThroughCommand, _devices, _note_cleared, _split_launch_args,
                                            follow_launched)
from orchestrator.runs.logview import note
from orchestrator.ui import State, emit, json_option, sigterm_raises


@click.command(cls=PassThroughCommand, passthrough="regen flags")
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[TARGET] [-- REGEN_ARGS...]")
@click.option("--prompts", required=True, metavar="FILE",
              help="JSONL here: chat rows (messages, or ShareGPT conversations) or {\"prompt\": ...}; "
                   "checked, then sent into the run's folder.")
@click.option("--model", "--target-model", "model", required=True, metavar="PATH|small-code",
              help="The model that answers: a Hugging Face folder on the target (the --target you train against).")
@click.option("--gpus", type=click.IntRange(min=0), metavar="N",
              help="GPUs to use, one worker each (default: all of the target's; 0 = CPU).")
@click.option("--gpu-ids", metavar="I,J", help="Exactly these GPUs of the target (e.g. 0,3); sets --gpus.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), metavar="N", help="Tokens per answer (default 512).")
@click.option("--batch-size", type=click.IntRange(min=1), metavar="B", help="Rows per generate call (default 16).")
@click.option("--temperature", type=click.FloatRange(min=0), metavar="T", help="0 = greedy (the default).")
@click.option("--thinking", is_flag=True, help="Let the chat template think (enable_thinking on; off by default).")
@click.option("--seed", type=int, metavar="N", help="For --temperature > 0.")
@click.option("--name", metavar="NAME", help="A label for the run, shown by status.")
@click.option("--follow", is_flag=True, help="Then follow the log, as `logs --follow` does.")
@click.option("--env", "env", multiple=True, metavar="K=V",
              help="Set a variable for regen (repeatable; over hosts.yaml env:).")
@json_option
@click.pass_obj
def regen(state: State, args, prompts, model, gpus, gpu_ids, max_new_tokens, batch_size, temperature, thinking,
          seed, name, follow, env, as_json):
    """Answer prompts with the target model itself, detached like a run; print the run id.

    The rows (the chat-row JSONL the trainer reads, each with its input line number) land in the
    run's folder on the target; `logs` shows progress (rows/s, tokens/s, ETA) and, at the end,
    the `--data PATH` to train on them (--follow streams it here, as `logs --follow` would).
    `launch --resume RUN` continues a stopped regen run.
    """
    from orchestrator.envvars import parse_assignments
    from orchestrator.runs import nodes
    from orchestrator.runs.regen import regen_options
    from orchestrator.ssh.session import owned_session as open_session

    targets, extra = _split_launch_args(state, args)
    if len(targets) > 1:
        raise UsageError(f"regen runs on one target; got {', '.join(t.name for t in targets)}")
    opts, rows = regen_options(prompts=prompts, model=model, gpus=gpus, gpu_ids=gpu_ids,
                               max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature,
                               thinking=thinking, seed=seed, name=name, extra=extra, env=parse_assignments(env))
    # SIGTERM as Ctrl-C: a launch under way is cut off saying which run may have started (nodes.launch)
    with sigterm_raises("regen"), open_session(state.inv) as session:   # one connection for launch and follow
        res = nodes.launch(state.inv, targets, opts, session=session)
        _note_cleared(res)
        node = res.nodes[0]
        doc = {**res.as_json(), "rows": rows, "prompts": opts.uploads[0]["path"]}
        if not follow:     # with --follow, stdout is the log (the run id is in the note), as for launch
            emit(as_json, doc, res.run)
        if not as_json:
            where = _devices(node.gpu_ids)
            note(f"{node.target}: regen run {res.run} (pid {node.pid}, {where}, release {node.release}): {rows} rows "
                 f"from {prompts}; its rows land in {node.output}"
                 + ("" if follow else f"; follow it with `dflash-ops logs {node.target} {res.run}`"))
        if follow:
            follow_launched(state, session, res, doc, as_json)
