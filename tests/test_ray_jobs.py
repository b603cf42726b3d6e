"""README's Ray Jobs block, run as a user pastes it on a fresh machine, and what a job may write.

The block is read out of README.md, so the two cannot drift. It runs under an empty HOME
(no token left behind by an earlier Ray), with its own Ray temp folder and free ports, so
it never meets the suite's Ray or one a user has running; its head is stopped by killing
the processes of that temp folder, never with `ray stop`, which ends every Ray process on
the machine.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from raysb.config import ConfigError
from raysb.distributed.cluster import check_paths_outlive_the_job
from raysb.distributed.ray_internals import JOB_CONFIG_VARIABLE

from conftest import environment_for_a_new_ray, needs_fashion_mnist
from doc_blocks import README, REPO, block_after
from test_cluster import descendants

pytestmark = pytest.mark.slow

README_PORT = "8265"


def free_ports(count: int) -> list[int]:
    """Ports free on every address. Ray's agents listen on the node's own IP, not on 127.0.0.1, so
    a port free on 127.0.0.1 may be held by the suite's Ray there. CI once saw `ray start --head`
    die after 30 s with "The current node timed out during startup" (one "RPC error: Deadline
    Exceeded"); holding --dashboard-agent-grpc-port on the node IP gives exactly that."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for probe in sockets:
            probe.bind(("", 0))
        return [probe.getsockname()[1] for probe in sockets]
    finally:
        for probe in sockets:
            probe.close()


def checkout_copy(folder: Path) -> Path:
    """The repository's tracked files (what a fresh clone holds), with this checkout's venv."""
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in listed.splitlines():
        source = REPO / name
        if source.is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / name)
    (folder / ".venv").symlink_to(REPO / ".venv")
    return folder


def stop_ray_of(temp_dir: Path) -> None:
    """End the Ray instance whose processes name `temp_dir`, and everything they started."""
    roots = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(temp_dir) in (entry / "cmdline").read_text(errors="replace"):
                roots.append(int(entry.name))
        except OSError:
            continue
    doomed = set(roots)
    for root in roots:
        doomed |= set(descendants(root))
    doomed.discard(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in doomed:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        # Up to 2 s for them to end (a fixed 2 s sleep each round once); those left get the next signal.
        deadline = time.monotonic() + 2
        while (doomed := {pid for pid in doomed if _running(pid)}) and time.monotonic() < deadline:
            time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether process `pid` is there and not a zombie (which has ended and only waits to be reaped)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@needs_fashion_mnist
def test_readme_ray_jobs_block_runs_a_two_worker_job_on_an_authenticated_cluster(tmp_path):
    commands = block_after(README, "### Ray Jobs").commands()
    assert commands[-1].startswith("ray stop"), "README's block ends by stopping the cluster"
    gcs, dashboard, client, agent_http, agent_grpc, metrics, env_agent = free_ports(7)
    script = []
    for command in commands[:-1]:
        if command.startswith("ray start --head"):
            # Free ports, so the head meets no other Ray on this machine.
            command += (
                f" --port {gcs} --dashboard-port {dashboard} --ray-client-server-port {client}"
                f" --dashboard-agent-listen-port {agent_http} --dashboard-agent-grpc-port {agent_grpc}"
                f" --metrics-export-port {metrics} --runtime-env-agent-port {env_agent} --disable-usage-stats"
            )
        script.append(command.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{dashboard}"))
    work = checkout_copy(tmp_path / "clone")
    home, stranger = tmp_path / "home", tmp_path / "stranger"
    home.mkdir()
    stranger.mkdir()
    env = environment_for_a_new_ray()
    with tempfile.TemporaryDirectory(prefix="rj", dir="/tmp") as ray_temp:  # Ray's socket paths stay short
        env.update(HOME=str(home), RAY_TMPDIR=ray_temp)
        try:
            done = subprocess.run(
                ["bash", "-ec", "\n".join(script)], cwd=work, env=env, capture_output=True, text=True, timeout=900
            )
            console = done.stdout + done.stderr
            assert done.returncode == 0, console[-3000:]
            assert "succeeded" in console
            # The job's console: raysb's epoch lines, none of Ray Train's per-report dictionaries.
            assert "epoch   2/2  test_err" in console and "metrics={" not in console
            # `ray job logs` shows the same lines afterwards.
            job_id = re.search(r"Job '(raysubmit_\w+)' succeeded", console).group(1)
            logs = subprocess.run(
                ["ray", "job", "logs", "--address", f"http://127.0.0.1:{dashboard}", job_id],
                cwd=work, env={**env, "RAY_AUTH_MODE": "token", "PATH": f"{work / '.venv' / 'bin'}:{env['PATH']}"},
                capture_output=True, text=True, timeout=120,
            )
            assert "epoch   2/2  test_err" in logs.stdout and "metrics={" not in logs.stdout, logs.stderr[-2000:]
            summary = json.loads((work / "runs" / "job" / "summary.json").read_text())
            assert summary["status"] == "completed" and summary["workers"] == 2 and summary["epochs_completed"] == 2

            # Someone without the token is refused, with the message README describes.
            refused = subprocess.run(
                ["ray", "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--", "python", "-c", "1"],
                cwd=work, env={**env, "HOME": str(stranger), "PATH": f"{work / '.venv' / 'bin'}:{env['PATH']}"},
                capture_output=True, text=True, timeout=120,
            )
            assert refused.returncode != 0
            message = "Token authentication is enabled but no authentication token was found"
            assert message in refused.stderr and message in (REPO / "README.md").read_text()
        finally:
            stop_ray_of(Path(ray_temp))


@pytest.mark.parametrize(
    "out, storage, refused",
    [
        ("runs/x", None, "--out runs/x: inside a Ray job"),
        ("{job}/runs/x", None, "--out {job}/runs/x: inside a Ray job"),  # absolute, but in the job's copy
        ("{elsewhere}/x", "ray_storage", "--storage-path ray_storage: inside a Ray job"),
        ("{elsewhere}/x", "s3://bucket/runs", None),
        ("{elsewhere}/x", None, None),
    ],
)
def test_a_ray_job_refuses_paths_that_would_vanish_with_it(tmp_path, monkeypatch, out, storage, refused):
    job, elsewhere = tmp_path / "working_dir_copy", tmp_path / "shared"
    job.mkdir()
    monkeypatch.chdir(job)
    fill = lambda text: text and text.format(job=job, elsewhere=elsewhere)  # noqa: E731
    paths = {"--out": fill(out), "--storage-path": storage}
    check_paths_outlive_the_job(paths)  # outside a job any path is the user's to choose
    monkeypatch.setenv(JOB_CONFIG_VARIABLE, json.dumps({"runtime_env": {}}))
    if refused is None:
        check_paths_outlive_the_job(paths)
    else:
        with pytest.raises(ConfigError, match=re.escape(fill(refused))):
            check_paths_outlive_the_job(paths)
