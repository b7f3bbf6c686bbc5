"""`dflash-ops tensorboard` for real: a short CPU run of the real trainer in a pct stand-in container
reached through a real sshd on 127.0.0.1 writes its metrics as TensorBoard event files; the command
brings them home incrementally and a real TensorBoard process serves them."""
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from trainer_quick import CLI_MAIN, tiny_run_config, wait_for

from trainer.run.trackers import scalars

# Steps logged one by one, an eval every 3 steps (eval/ tags at 3 and 6, the final one at 8 in `done`).
CONFIG = tiny_run_config(steps=8, eval_every=3)


@pytest.fixture
def ct(fakepct, deployed_ct200, tmp_path):
    """CT 200 with the trainer deployed and one finished run; the CLI's home in tmp_path."""
    path = deployed_ct200()
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CONFIG)
    env = dict(os.environ, DFLASH_OPS_HOME=str(tmp_path / "home"))

    def cli(*args, timeout=180):
        return subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(path), *map(str, args)],
                              capture_output=True, timeout=timeout, env=env)

    r = cli("launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", cfg)
    assert r.returncode == 0, r.stderr.decode()
    run = r.stdout.decode().strip()
    r = cli("logs", "ct200", run, "--follow")
    assert r.returncode == 0, r.stderr.decode()
    rundir = fakepct.private(200) / "dflash" / "runs" / run
    return type("Ct", (), {"cli": staticmethod(cli), "run": run, "rundir": rundir, "env": env,
                           "home": tmp_path / "home" / "tensorboard", "inv_path": path})


def _records(rundir: Path) -> list[dict]:
    return [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]


def _events(folder: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})   # 0: every event, none sampled away
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_no_serve_brings_event_files_home_whose_scalars_match_metrics_jsonl(ct):
    r = ct.cli("tensorboard", "ct200", ct.run, "--no-serve", "--json")
    assert r.returncode == 0, r.stderr.decode()
    doc = json.loads(r.stdout)
    [got] = doc["runs"]
    local = ct.home / "ct200" / ct.run
    assert got["folder"] == str(local) and got["state"] == "succeeded" and got["files"] == 1
    remote = sorted((ct.rundir / "tensorboard").iterdir())
    assert [p.name for p in local.iterdir()] == [p.name for p in remote]
    assert got["new_bytes"] == remote[0].stat().st_size
    assert (local / remote[0].name).read_bytes() == remote[0].read_bytes()

    # Step for step: every number of every step record and eval in metrics.jsonl, and nothing else.
    events = _events(local)
    records = _records(ct.rundir)
    want: dict[str, list[tuple[int, float]]] = {}
    for rec in records:
        for tag, value in scalars(rec):
            want.setdefault(tag, []).append((rec["step"], value))
    steps = [rec["step"] for rec in records if "loss" in rec and "event" not in rec]
    assert steps == list(range(1, 9))
    assert [s for s, _ in events["train/loss"]] == steps
    assert [s for s, _ in events["eval/tau"]] == [0, 3, 6, 8]     # the untrained baseline first
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "train/peak_memory_gb", "train/accuracy",
            "train/acc_per_position/1", "eval/accept_rate_by_position/1"} <= set(events)
    assert set(events) == set(want)
    for tag, points in want.items():
        assert [s for s, _ in events[tag]] == [s for s, _ in points], tag
        for (_, seen), (_, value) in zip(events[tag], points):
            assert seen == pytest.approx(value, rel=1e-6, abs=1e-12), tag     # float32 of a 6-decimal number

    # Incremental: nothing new is nothing sent; a copy cut short gets only its missing tail.
    r = ct.cli("tensorboard", "ct200", ct.run, "--no-serve", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["runs"][0]["new_bytes"] == 0
    copy = local / remote[0].name
    whole = copy.read_bytes()
    copy.write_bytes(whole[:100])
    r = ct.cli("tensorboard", "ct200", "--no-serve", "--json")        # RUN defaults to the latest
    assert r.returncode == 0 and json.loads(r.stdout)["runs"][0]["new_bytes"] == len(whole) - 100
    assert copy.read_bytes() == whole


def test_bad_input_is_one_line_and_its_exit_code(ct):
    for args, code, words in ((["ct200", "20200101-000000-abcdef", "--no-serve"], 102, "no run '20200101-000000-abc"),
                              (["ct200", "../etc", "--no-serve"], 2, "is not a run id"),
                              (["nosuchtarget", "--no-serve"], 2, "nosuchtarget")):
        r = ct.cli("tensorboard", *args)
        err = r.stderr.decode()
        assert r.returncode == code, (args, err)
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    r = ct.cli("tensorboard", "ct200", "--port", "99999")     # Click's refusal, naming the option
    assert r.returncode == 2 and b"Invalid value for '--port'" in r.stderr and b"Traceback" not in r.stderr


BROWSER = shutil.which("chromium-headless-shell") or shutil.which("chromium")


def _screenshot(url: str, png: Path) -> None:
    """The scalars dashboard, filtered to train/loss, as a headless browser shows it (its path printed:
    `pytest -rA` or `-s` shows it); without a browser (.ci/run installs Debian's chromium-headless-shell),
    nothing. The time series tab draws with WebGL, which a headless browser without a GPU leaves blank;
    the scalars tab draws SVG."""
    if BROWSER is None:
        print("no headless browser here: no screenshot")
        return
    r = subprocess.run([BROWSER, "--no-sandbox", "--hide-scrollbars", "--window-size=1400,1000",
                        "--virtual-time-budget=30000", f"--screenshot={png}",
                        f"{url}#scalars&tagFilter=train%2Floss&_smoothingWeight=0"],
                       capture_output=True, timeout=180, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr.decode()[-2000:]
    print(f"screenshot of the served train/loss curve: {png}")


@pytest.mark.slow
def test_a_real_tensorboard_serves_the_runs_loss(ct, tmp_path):
    """The command starts TensorBoard on a free loopback port; its HTTP scalars API has the run's loss,
    step for step. Ctrl-C ends it (exit 130) and TensorBoard with it."""
    proc = subprocess.Popen([sys.executable, "-c", CLI_MAIN, "-i", str(ct.inv_path), "tensorboard", "ct200", ct.run,
                             "--port", "0", "--every", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=ct.env)
    try:
        url = None
        assert proc.stdout is not None
        for raw in proc.stdout:              # the synced line, then TensorBoard's URL
            line = raw.decode()
            if line.startswith("TensorBoard: "):
                url = line.split()[1]
                break
        assert url and url.startswith("http://127.0.0.1:"), proc.stderr.read().decode() if proc.stderr else ""
        query = urllib.parse.urlencode({"run": f"ct200/{ct.run}", "tag": "train/loss"})
        losses = [(rec["step"], rec["loss"]) for rec in _records(ct.rundir) if "loss" in rec and "event" not in rec]

        def scalars_served():               # [[wall_time, step, value], ...] once TensorBoard has read the files
            try:
                with urllib.request.urlopen(f"{url}data/plugin/scalars/scalars?{query}", timeout=60) as resp:
                    points = json.loads(resp.read())
            except urllib.error.HTTPError:  # 400 "no scalar data" before its first reload
                return None
            return points if len(points) >= len(losses) else None
        served = wait_for(scalars_served, timeout=120, what="TensorBoard serving the run's loss", every=0.5)
        assert [s for _, s, _ in served] == [s for s, _ in losses]
        assert [v for _, _, v in served] == pytest.approx([v for _, v in losses], rel=1e-6)
        _screenshot(url, tmp_path / "tensorboard-train-loss.png")
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert err.decode().strip().endswith(f"tensorboard: stopped (SIGINT); the event files stay in {ct.home}")
    with pytest.raises(OSError):        # TensorBoard ended with the command
        urllib.request.urlopen(url, timeout=5)
