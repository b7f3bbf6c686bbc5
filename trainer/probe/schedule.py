"""The probe's cases side by side, each timed alone.

A case spends most of its time importing torch, building the target and compiling (the CPU, the
compile workers, the compile caches); its timed phase is a second or two. So on a GPU host with
cores to spare, `--jobs N` case processes run at once, and every timed phase runs ALONE:

  1. A case reaches its timed phase, announces it (PHASE_MARK timed) and waits for its gate file
     (watch.wait_for_turn; GATE_ENV names the file).
  2. The parent takes the one turn (one timed phase at a time; other cases that reach theirs wait),
     SIGSTOPs every other running case, its process group and every process under it (torchrun's
     ranks run in sessions of their own: watch.signal_tree walks /proc), waits SETTLE_S for the
     GPU work they had queued to drain, and creates the gate file.
  3. The case times its steps and announces `verdict`; the parent SIGCONTs the others and gives the
     turn back. No case STARTS while a turn is held, so nothing new runs beside a timed phase.

A case's timeout does not count the seconds it waited to start, was stopped or waited for its turn.
A timed phase that has not ended after MAX_ALONE_S lets the others go on and the next cases start (a
stopped case might hold a lock the timed one needs); that case's `schedule.alone` is then false.
What stays shared is the GPU's memory (the stopped cases keep theirs) and the compile caches
(compile_caches).
The compile time of a case (`first_step_s`) does include the neighbours' load; the step times do not.

`run_all` runs the cases, at most `jobs` at once, in the order given (`run_order`); with jobs=1 one
after the other, no gate and no stops. `compile_caches` is the environment they share.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time

from trainer.probe.case_watch import GATE_ENV, kill_tree, signal_tree

SETTLE_S = 0.25        # after stopping the others: their queued GPU kernels finish meanwhile
MAX_ALONE_S = 120.0    # a timed phase longer than this lets the others go on (then not `alone`)
TIMED, DONE = "timed", "verdict"


class Turns:
    """The one timed phase at a time, and the running cases it stops."""

    def __init__(self, gate_dir: str, started: float, settle_s: float = SETTLE_S,
                 max_alone_s: float = MAX_ALONE_S):
        self.gate_dir, self.t0 = gate_dir, started
        self.settle_s, self.max_alone_s = settle_s, max_alone_s
        self.cv = threading.Condition()
        self.running: list[Control] = []
        self.holder: Control | None = None
        self.stopped: list[Control] = []
        self.timer: threading.Timer | None = None
        self.overrun = False    # the holder's timed phase passed max_alone_s: the others go on, cases start

    def take(self, ctl: "Control") -> None:
        """`ctl`'s timed phase: wait for the turn, stop every other running case, open its gate.
        All under the lock, so that no case starts, ends or takes the turn halfway through."""
        t = time.monotonic()
        ctl.waiting_since = t
        with self.cv:
            while self.holder is not None and not ctl.over:
                self.cv.wait()
            ctl.waited_s += time.monotonic() - t
            ctl.waiting_since = None
            if ctl.over:
                return
            self.holder = ctl
            self.stopped = [c for c in self.running if c is not ctl]
            for c in self.stopped:
                c.pause(ctl.label)
            time.sleep(self.settle_s if self.stopped else 0.0)
            ctl.window = [time.monotonic() - self.t0, None]
            self.timer = threading.Timer(self.max_alone_s, self._overrun, (ctl,))
            self.timer.daemon = True
            self.timer.start()
            try:
                with open(os.path.join(self.gate_dir, ctl.gate), "w"):
                    pass
            except OSError:
                pass       # the probe is ending (its gate folder is gone)

    def give(self, ctl: "Control") -> None:
        """`ctl`'s timed phase ended (or the case did): the others go on, the next turn may start."""
        with self.cv:
            if self.holder is not ctl:
                return
            if self.timer:
                self.timer.cancel()
            if ctl.window and ctl.window[1] is None:
                ctl.window[1] = time.monotonic() - self.t0
            self._resume()
            self.holder, self.overrun = None, False
            self.cv.notify_all()

    def _overrun(self, ctl: "Control") -> None:
        with self.cv:
            if self.holder is ctl:
                self.overrun = True
                if self.stopped:
                    ctl.alone = False
                    self._resume()
                self.cv.notify_all()     # a case waiting to start starts now

    def _resume(self) -> None:
        for c in self.stopped:
            c.resume()
        self.stopped = []


class Control:
    """One case's side of the schedule, handed to watch.run_isolated."""

    def __init__(self, turns: Turns | None, label: str, gate: str):
        self.turns, self.label, self.gate = turns, label, gate
        self.pid: int | None = None
        self.reached: list[int] = []
        self.paused_since: float | None = None
        self.paused_by = ""
        self.paused_s = self.waited_s = 0.0
        self.waiting_since: float | None = None
        self.timed = False
        self.over = False
        self.halted = False     # killed because the probe was stopped: its record means nothing
        self.alone = True
        self.window: list | None = None
        self.lock = threading.Lock()

    def env(self) -> dict:
        """What the case's environment gets: its gate file, when cases run side by side."""
        return {GATE_ENV: os.path.join(self.turns.gate_dir, self.gate)} if self.turns else {}

    @contextlib.contextmanager
    def launch(self):
        """Around the case's Popen: no case starts while a timed phase runs (unless it overran
        max_alone_s: then that phase is not alone anyway); registered at once."""
        if self.turns is None:
            yield self._register
            return
        with self.turns.cv:
            while self.turns.holder is not None and not self.turns.overrun:
                self.turns.cv.wait()
            if self.turns.holder is not None:
                self.turns.holder.alone = False
            yield self._register
            self.turns.running.append(self)

    def _register(self, pid: int) -> None:
        with self.lock:
            self.pid, halted = pid, self.halted
        if halted:      # the probe was stopped while this case's process was being started
            kill_tree(pid)

    def halt(self) -> None:
        """The probe was stopped: the case's processes are killed, now or as soon as it has one (a stop
        between its Popen and its registration would otherwise leave it running)."""
        with self.lock:
            self.halted, pid = True, self.pid
        if pid is not None:
            kill_tree(pid)

    def on_phase(self, phase: str) -> None:
        if self.turns is None:
            return
        if phase == TIMED and not self.timed:      # (the ranks of a DDP case each announce it)
            self.timed = True
            self.turns.take(self)
        elif phase == DONE:
            self.turns.give(self)

    def ended(self) -> None:
        if self.turns is None:
            return
        self.turns.give(self)
        with self.turns.cv:
            self.over = True
            if self in self.turns.running:
                self.turns.running.remove(self)
            self.turns.cv.notify_all()

    def pause(self, by: str) -> None:
        with self.lock:
            if self.pid is not None and self.paused_since is None:
                self.reached = signal_tree(self.pid, signal.SIGSTOP)
                self.paused_since, self.paused_by = time.monotonic(), by

    def resume(self) -> None:
        with self.lock:
            if self.paused_since is not None:
                assert self.pid is not None         # pause() saw it
                signal_tree(self.pid, signal.SIGCONT, self.reached)
                self.paused_s += time.monotonic() - self.paused_since
                self.paused_since = None

    def held_s(self) -> float:
        """Seconds this case was held: stopped for another's timed phase, or waiting for its own."""
        now = time.monotonic()
        return (self.paused_s + self.waited_s + (now - self.paused_since if self.paused_since else 0.0)
                + (now - self.waiting_since if self.waiting_since else 0.0))

    def phase_text(self, phase: str) -> str:
        if self.paused_since is not None:
            return f"{phase}, stopped while {self.paused_by} is timed"
        return f"{phase}, waiting for its turn to be timed alone" if self.waiting_since else phase

    def record(self) -> dict:
        """What the case record keeps of it: whether its timed phase ran alone, when (seconds since
        the probe started), and how long the case was held."""
        return {"alone": self.alone, "timed_at": [round(x, 3) for x in self.window] if self.window else None,
                "paused_s": round(self.paused_s, 2), "waited_s": round(self.waited_s, 2)}


def run_order(indexes: list[int], plan: list[tuple], jobs: int, cost_order: tuple) -> list[int]:
    """The order cases start in. One at a time: as planned (the cheapest compiles first, so that a probe
    stopped early has the answers that matter). Side by side: every `threads` case before the
    `processes` ones (a policy's DDP case then finds its kernels in the compile caches, made by its
    threads case) and, within a topology, the dearest compile first (max-autotune's autotuning is the
    longest case: started first, it ends while the others run)."""
    if jobs <= 1:
        return list(indexes)
    tops = list(dict.fromkeys(t for _, t, _ in plan))
    return sorted(indexes, key=lambda i: (tops.index(plan[i][1]), -cost_order.index(plan[i][0])))


@contextlib.contextmanager
def compile_caches(workdir: str | None):
    """The environment every case gets so that a kernel compiled by one case is not compiled again by
    the next: one inductor cache (FX graphs, AOTAutograd, C++/Triton kernels, autotuning results) and
    one Triton cache, in WORKDIR/probe-compile-cache (kept for the next probe; delete it freely), else
    in a temporary folder for this probe. The FX graph and AOTAutograd caches on (torch's default;
    set here so that an environment that turned them off does not cost every case its compile). A
    variable already set wins. Each case keeps torch's own count of compile workers (one per core, up
    to 32): side by side they are idle most of the time, and max-autotune, the longest case, compiles
    its candidate kernels on all of them."""
    folder = os.path.join(workdir, "probe-compile-cache") if workdir else tempfile.mkdtemp(prefix="dflash-probe-")
    want = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(folder, "triton"),
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    try:
        yield {k: v for k, v in want.items() if not _callers(k)}
    finally:
        if not workdir:
            shutil.rmtree(folder, ignore_errors=True)


def _callers(key: str) -> str | None:
    """The caller's own setting of `key`. Inductor's first use in a process exports its default
    TORCHINDUCTOR_CACHE_DIR into os.environ (torch/_inductor/runtime/cache_dir_utils.cache_dir), so
    that value, once the probe has touched inductor, is torch's doing, not a choice to keep."""
    value = os.environ.get(key)
    if key == "TORCHINDUCTOR_CACHE_DIR" and value and os.path.abspath(value) == _inductor_default():
        return None
    return value


def _inductor_default() -> str | None:
    """torch's default inductor cache dir (None on a torch without cache_dir_utils, before 2.6)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())


def run_all(items: list, jobs: int, run_one, started: float | None = None, name=str) -> dict:
    """run_one(item, control) for each item (hashable), at most `jobs` at once, started in the order
    given; returns {item: result}. Stopped (an exception in this thread, e.g. SIGTERM's): no case
    starts any more, the running ones are killed (their controls `halted`), and Interrupted says
    what had ended and what was running. `name(item)` names a case in the others' heartbeats."""
    started = time.monotonic() if started is None else started
    gate_dir = tempfile.mkdtemp(prefix="dflash-probe-gates-") if jobs > 1 else None
    turns = Turns(gate_dir, started, max_alone_s=MAX_ALONE_S) if gate_dir is not None else None    # jobs > 1
    slots = threading.Semaphore(max(1, jobs))
    results: dict = {}
    errors: list = []
    running: dict = {}
    threads = []

    def one(item, ctl: Control) -> None:
        try:
            results[item] = run_one(item, ctl)
        except BaseException as e:  # noqa: BLE001 - raised again in the calling thread
            errors.append(e)
        finally:
            running.pop(item, None)
            slots.release()

    try:
        for k, item in enumerate(items):
            while not slots.acquire(timeout=0.2):
                pass
            ctl = Control(turns, name(item), f"case-{k}.go")
            running[item] = ctl
            t = threading.Thread(target=one, args=(item, ctl), name=f"probe-case-{k}", daemon=True)
            threads.append(t)
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.2)
    except BaseException:
        stopped = list(running)
        for ctl in list(running.values()):
            ctl.halt()
        for t in threads:
            t.join(timeout=10)
        raise Interrupted(results, stopped) from None
    finally:
        if gate_dir:
            shutil.rmtree(gate_dir, ignore_errors=True)
    if errors:
        raise errors[0]
    return results


class Interrupted(Exception):
    """run_all was stopped: the results so far and the cases it was running."""

    def __init__(self, results: dict, stopped: list):
        super().__init__("stopped")
        self.results, self.stopped = results, stopped
