"""`targets --check`: reach every target in parallel and report what is there."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from orchestrator.ssh import agent_call
from orchestrator.ssh import fanout
from orchestrator.ssh.session import owned_session
from orchestrator.errors import ConnectError, ContainerError, OpsError
from orchestrator.inventory import Inventory, Target
from orchestrator.ssh.session import Session
from orchestrator.ssh.pct import PctTransport


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
    warnings: list[str] = field(default_factory=list)   # what would break GPU training there, each with its remedy

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


MiB, GiB = 1 << 20, 1 << 30
SHM_MIN = 1 * GiB          # NCCL's shared-memory transport: a few MB per peer and channel; Docker's 64 MB breaks it
MEMLOCK_MIN = 1 * GiB      # pinned host memory (pin_memory, NCCL's buffers, InfiniBand): 8 MB or 64 KB defaults fail
DISK_MIN = 10 * GiB        # checkpoints of a real drafter (and its optimizer state) are GBs each
DISK_MIN_FRACTION = 0.05
DISK_LINE = "low disk: "     # a warning, not a failure: training runs until the disk fills


def _size(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB" if n >= MiB else f"{n / 1024:.0f} KiB"


def training_warnings(t: Target, facts: dict) -> list[str]:
    """One line per fact of the target (orchestrator/remote/release/release_agent.py, machine_facts) that breaks
    training there, each with its remedy; GPU facts only for a target with `gpus:`. docs/containers.md."""
    out: list[str] = []
    conf = f"/etc/pve/lxc/{t.vmid}.conf" if t.vmid is not None else None
    if t.gpus and "nvidia_nodes" in facts and not any(n.startswith("nvidia") and n[6:].isdigit()
                                                      for n in facts["nvidia_nodes"]):
        out.append(f"no /dev/nvidia* GPU device nodes{' in CT %s' % t.vmid if conf else ''} (hosts.yaml gives it "
                   f"{t.gpus} GPU(s)): "
                   + ("pass them through: `dev0: /dev/nvidia0` ... plus /dev/nvidiactl, /dev/nvidia-uvm in " + conf
                      + " (PVE >= 8.1), or lxc.cgroup2.devices.allow: c 195:* rwm and lxc.mount.entry: "
                        "/dev/nvidia0 dev/nvidia0 none bind,optional,create=file per node"
                      if conf else "install the NVIDIA driver, or set `gpus: 0`"))
    shm = facts.get("shm")
    if t.gpus and "shm" in facts and (shm is None or shm["total"] < SHM_MIN):
        what = "no /dev/shm" if shm is None else f"/dev/shm is {_size(shm['total'])}"
        out.append(f"{what}: NCCL's shared-memory transport and torch's worker processes need more "
                   f"(>= {_size(SHM_MIN)}); "
                   + (f"mount a bigger one, `lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,create=dir,"
                      f"size=16G 0 0` in {conf}" if conf
                      else "remount it bigger (`mount -o remount,size=16G /dev/shm`)"))
    memlock = facts.get("memlock")
    if t.gpus and memlock and memlock[0] is not None and memlock[0] < MEMLOCK_MIN:
        out.append(f"locked memory is limited to {_size(memlock[0])} (ulimit -l): pinned host memory (NCCL, "
                   "pin_memory) fails or falls back; "
                   + (f"`lxc.prlimit.memlock: unlimited` in {conf}" if conf
                      else "raise memlock to unlimited in /etc/security/limits.conf"))
    disk = facts.get("disk")
    if disk and disk["total"] and (disk["free"] < DISK_MIN or disk["free"] < DISK_MIN_FRACTION * disk["total"]):
        out.append(f"{DISK_LINE}{disk['path']} (where {t.workdir} is) has {_size(disk['free'])} free of "
                   f"{_size(disk['total'])}: "
                   f"checkpoints need GBs; free space (`dflash-ops prune {t.name} --keep 2`)"
                   + (f" or grow the CT's disk (`pct resize {t.vmid} rootfs +50G`)" if t.vmid is not None else ""))
    return out


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
        live = agent_call.call(transport, t, agent_call.RELEASE, ["manifest", t.workdir, "--no-files", "--facts"],
                          what="check python")
        c.python, c.torch, c.release = live["python"], live["torch"], live["release"]
        c.warnings = training_warnings(t, live.get("facts") or {})
        c.ok = bool(c.torch) or not judge
        broken = [w for w in c.warnings if not w.startswith(DISK_LINE)]   # the GPU facts: training fails there
        if broken and judge and c.ok:
            c.ok = False
            c.error = (f"{t.name}: {len(broken)} thing(s) in this container break GPU training "
                       "(each below, with its remedy)")
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
    with owned_session(inv) as session:
        group = fanout.fan_out(targets, lambda t: check_one(session, inv, t, judged(inv, t, names)))
    return [o.value if o.ok else Check(name, describe(inv, inv.target(name)), error=o.error.render())
            for name, o in group.items()]
