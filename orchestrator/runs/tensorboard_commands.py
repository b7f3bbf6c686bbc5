"""Click command `tensorboard`: runs' event files brought home (runs/tensorboard.py), then served.

Thin: parse the words, call `sync`, start the `Server`, print; `watch` keeps the copies in sync until
Ctrl-C.
"""
from __future__ import annotations

import signal

import click

from orchestrator.errors import Interrupted, Terminated
from orchestrator.inventory import Inventory, Target
from orchestrator.inventory.names import RUN_ID_RE
from orchestrator.runs.logview import note
from orchestrator.runs.options import check_run
from orchestrator.ui import State, emit, json_option, sigterm_raises, size_text


def _split(inv: Inventory, words: tuple[str, ...]) -> tuple[list[Target], list[str]]:
    """`[TARGET] [RUN...]`: the first word names the target(s) (`T1,T2` or a group: a run over several
    nodes, or runs of several) unless it is a run id or `latest`; the runs default to the latest."""
    words_left = list(words)
    targets = [inv.default_target()]
    if words_left and (words_left[0] in inv.targets or words_left[0] in inv.groups or
                       not (words_left[0] == "latest" or RUN_ID_RE.match(words_left[0]))):
        targets = inv.expand(words_left.pop(0))
    return targets, [check_run(w) for w in words_left] or ["latest"]


def _lines(runs) -> str:
    return "\n".join(f"{r.target}/{r.run} ({r.state}): {r.files} event file(s), {size_text(r.new_bytes)} new "
                     f"-> {r.folder}" for r in runs)


@click.command()
@click.argument("words", nargs=-1, metavar="[TARGET] [RUN...]")
@click.option("--no-serve", is_flag=True, help="Only bring the event files home, then exit.")
@click.option("--port", type=click.IntRange(min=0, max=65535), metavar="N",
              help="TensorBoard's port on 127.0.0.1 (default: 6006, or the next free one; 0: any free port).")
@click.option("--every", type=click.FloatRange(min=1), default=10, show_default=True, metavar="S",
              help="While serving, bring new bytes home every S seconds.")
@json_option
@click.pass_obj
def tensorboard(state: State, words, no_serve, port, every, as_json):
    """Bring runs' TensorBoard event files home (default: the latest run), incrementally, into
    $DFLASH_OPS_HOME/tensorboard/TARGET/RUN, and serve that folder with TensorBoard on 127.0.0.1,
    printing its URL; the copies are kept in sync until Ctrl-C.

    Exit status: 0 (--no-serve: synced), 1 a target could not be reached or TensorBoard did not start,
    2 bad input (or serving without the tensorboard package), 102 no such run, 130 / 143 Ctrl-C /
    SIGTERM ended the serving (the copies stay).
    """
    from orchestrator.runs import tensorboard as tb
    from orchestrator.ssh.session import owned_session

    inv = state.inv
    targets, runs = _split(inv, words)
    if not no_serve:
        tb.require_server()     # before anything travels
    with sigterm_raises("tensorboard"), owned_session(inv) as session:
        got = tb.sync(inv, targets, runs, session=session)
        doc = {"folder": str(tb.home()), "runs": [r.as_json() for r in got], "url": None}
        if no_serve:
            emit(as_json, doc, _lines(got))
            return
        if not as_json:
            click.echo(_lines(got))
        server = tb.Server(tb.home(), port)
        try:
            doc["url"] = url = server.wait_url()
            emit(as_json, doc, f"TensorBoard: {url} (serving {tb.home()}; new bytes every {every:g} s; "
                               "Ctrl-C to stop)")
            pinned = sorted({r.run for r in got})     # `latest` stays the run it was
            tb.watch(inv, targets, pinned, session, every,
                     on_pass=lambda rs: None if as_json else note(_lines(r for r in rs if r.new_bytes)),
                     on_error=lambda e: note(f"tensorboard: {e.render()}; trying again in {every:g} s"))
        except KeyboardInterrupt as e:      # Ctrl-C, or SIGTERM as errors.Terminated: how serving ends
            signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
            raise Interrupted(signum, f"tensorboard: stopped ({signum.name}); the event files stay in "
                                      f"{tb.home()}") from None
        finally:
            server.stop()
