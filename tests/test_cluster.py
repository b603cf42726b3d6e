"""The driver and Ray clusters that are stale or die: never a hang, always a clear error in seconds.

Each test runs `raysb train` in a subprocess with its own Ray temp folder (so the
stale-cluster file it plants touches nothing else) under a hard timeout, so a
regression fails here instead of hanging CI.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from raysb.distributed.cluster import CLUSTER_LOST_EXIT_CODE
from raysb.training.outputs import read_metrics

from conftest import needs_fashion_mnist

pytestmark = needs_fashion_mnist

TINY_RUN = [
    "--workers", "1", "--cpus-per-worker", "1", "--subset", "1000", "--test-subset", "200",
    "--batch-size", "32", "--set", "model_options.width=4",
]


@pytest.fixture
def ray_tmpdir():
    """A short private Ray temp folder (Ray's socket paths must stay under 108 bytes)."""
    with tempfile.TemporaryDirectory(prefix="rt", dir="/tmp") as folder:
        yield Path(folder)


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def plant_stale_cluster(ray_tmpdir: Path) -> str:
    """What a `ray start --head` killed without `ray stop` leaves behind."""
    address = f"127.0.0.1:{closed_port()}"
    (ray_tmpdir / "ray").mkdir()
    (ray_tmpdir / "ray" / "ray_current_cluster").write_text(address)
    return address


def raysb_env(ray_tmpdir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = str(ray_tmpdir)
    return env


def descendants(root: int) -> dict[int, str]:
    """pid -> process name of every process below `root`, from /proc."""
    parents, names = {}, {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        if entry.name.isdigit():
            # "pid (name) state ppid ...": the name may hold spaces, so split after its ')'.
            parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
            names[int(entry.name)] = stat[stat.index("(") + 1 : stat.rindex(")")]
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = names[pid]
                frontier.append(pid)
    return found


def raysb(*args) -> list[str]:
    return [sys.executable, "-m", "raysb.cli", "train", *args]


def test_address_auto_with_a_stale_cluster_file_fails_within_seconds(ray_tmpdir, tmp_path):
    address = plant_stale_cluster(ray_tmpdir)
    started = time.monotonic()
    done = subprocess.run(
        raysb(*TINY_RUN, "--epochs", "1", "--address", "auto", "--out", str(tmp_path / "run")),
        env=raysb_env(ray_tmpdir), capture_output=True, text=True, timeout=60,
    )
    wall = time.monotonic() - started
    assert done.returncode != 0
    port = address.rpartition(":")[2]
    assert "cannot reach the Ray cluster at" in done.stderr and f":{port} " in done.stderr
    assert "ray stop" in done.stderr and "drop --address" in done.stderr
    assert wall < 30, f"took {wall:.1f}s"
    print(f"--address auto, stale file: clear error in {wall:.1f}s")


@pytest.mark.slow
def test_head_killed_mid_run_ends_the_driver_with_a_clear_error(ray_tmpdir, tmp_path):
    out = tmp_path / "run"
    driver = subprocess.Popen(
        raysb(*TINY_RUN, "--epochs", "100", "--out", str(out)),
        env=raysb_env(ray_tmpdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        # Wait for a committed checkpoint, then kill the head: its GCS and raylet.
        deadline = time.monotonic() + 180
        while not (out / "last_checkpoint.json").exists():
            assert driver.poll() is None, driver.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint was committed in time"
            time.sleep(0.5)
        head = {pid: name for pid, name in descendants(driver.pid).items() if name in ("gcs_server", "raylet")}
        assert sorted(head.values()) == ["gcs_server", "raylet"]
        for pid in head:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = driver.communicate(timeout=90)
        wall = time.monotonic() - killed
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode == CLUSTER_LOST_EXIT_CODE, stderr[-2000:]
    assert "raysb: lost the Ray cluster" in stderr and "--resume" in stderr
    assert wall < 60, f"took {wall:.1f}s"
    # What was written before the loss is intact and readable (the one worker may still be writing:
    # it outlives its raylet by a moment, and each row replaces the file whole).
    rows = read_metrics(out / "metrics.parquet")
    committed = json.loads((out / "last_checkpoint.json").read_text())
    assert rows and committed["epoch"] >= 1 and Path(committed["path"]).is_dir()
    print(f"head killed mid-run: driver ended in {wall:.1f}s with exit code {driver.returncode}")
