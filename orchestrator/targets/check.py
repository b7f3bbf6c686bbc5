"""`targets --check`: reach every target in parallel and report what is there."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from orchestrator.ssh import agent
from orchestrator.errors import ConnectError, ContainerError, OpsError
from orchestrator.inventory import Inventory, Target
from orchestrator.ssh.session import Session
from orchestrator.ssh.transport import PctTransport


@dataclass
class Check:
    target: str
    where: str
    ok: bool = False
    reachable: bool | None = None
    container: str | None = None     # "running" | pct's state ("stopped") | "error" (the error says) | None (no pct)
    python: str | None = None
    torch: str | None = None
    release: str | None = None
    seconds: float = 0.0
    error: str | None = None
    note: str | None = None          # a fact that does not fail the check (local without torch, not judged)

    def as_json(self) -> dict:
        return asdict(self)


def describe(inv: Inventory, t: Target) -> str:
    if t.host is None:
        where = "this machine"
    else:
        h = inv.hosts[t.host]
        where = f"{h.user}@{h.address}:{h.port}" + (f" via {h.jump}" if h.jump else "")
    return where + (f" CT {t.vmid}" if t.vmid is not None else "")


def judged(inv: Inventory, t: Target, names: list[str] | None) -> bool:
    """Whether a target's missing torch fails `targets --check`: always for a target named or one
    of hosts.yaml's; the built-in `local` only when it is named, is `default:`, or is the only target
    (no hosts.yaml). Users of remote targets need no torch on their laptop."""
    if names or t.name != "local":
        return True
    return inv.default == "local" or list(inv.targets) == ["local"]


def check_one(session: Session, inv: Inventory, t: Target, judge: bool = True) -> Check:
    c = Check(t.name, describe(inv, t))
    start = time.monotonic()
    try:
        transport = session.transport(t, check=False)
        c.reachable = True
        if t.vmid is not None:
            assert isinstance(transport, PctTransport)      # what Session.transport gives a pct target
            transport.check()
            c.container = "running"
        live = agent.call(transport, t, agent.RELEASE, ["manifest", t.workdir, "--no-files"],
                          what="check python")
        c.python, c.torch, c.release = live["python"], live["torch"], live["release"]
        c.ok = bool(c.torch) or not judge
        if not c.torch and judge:   # the trainer cannot run there: a failed check, with the command that fixes it
            c.error = (f"{t.name}: {live.get('executable') or t.python} has no torch; install it with "
                       f"`dflash-ops play playbooks/bootstrap.yaml {t.name} --var torch=...` "
                       f"(or point `python:` in hosts.yaml at an interpreter that has it)")
        elif not c.torch:
            c.note = f"{live.get('executable') or t.python} has no torch (not judged: name {t.name} to check it)"
    except ContainerError as e:      # the state in its column, the sentence once, in the error
        c.container, c.error = e.state or "error", e.render()
    except ConnectError as e:
        c.reachable, c.error = False, e.render()
    except OpsError as e:
        c.error = e.render()
    c.seconds = round(time.monotonic() - start, 3)
    return c


def check(inv: Inventory, names: list[str] | None = None) -> list[Check]:
    """Every target (or those named) reached in parallel; a Check each, failures included (`ok`
    false; a fact that is not judged, such as local without torch, is a `note`)."""
    targets = inv.select(names) if names else list(inv.targets.values())
    with agent.session(inv) as session:
        group = agent.fan_out(targets, lambda t: check_one(session, inv, t, judged(inv, t, names)))
    return [o.value if o.ok else Check(name, describe(inv, inv.target(name)), error=o.error.render())
            for name, o in group.items()]
