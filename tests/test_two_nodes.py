"""Ray jobs on several Ray nodes of this machine, one of which is lost mid-run.

`ray start` processes stand in for a cluster's machines: in the first test a head and a
second node with one CPU each, so that a 2-worker job (1 CPU a worker) must use both, and
later a third node, the replacement an autoscaler would start; in the second, three nodes
of two CPUs that a SPREAD group of 4 workers spans, and that can hold it on any two of them.
Killing a node's raylet and everything under it is what a lost machine looks like to Ray.
Each cluster runs under its own temp folder on free ports, and is ended by killing that
folder's processes, never with `ray stop`.
"""

import pytest
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq

from conftest import environment_for_a_new_ray, needs_fashion_mnist
from test_cluster import descendants
from test_ray_jobs import checkout_copy, free_ports, stop_ray_of

pytestmark = pytest.mark.slow

# The run: small epochs, and more of them than it trains before the second loss ends it.
RUN = "--workers 2 --dataset fashion-mnist --subset 2000 --test-subset 500 --epochs 50 --progress-seconds 0"


class LocalCluster:
    """Ray nodes started on this machine with `ray start`, each on its own free ports."""

    def __init__(self, folder: Path, env: dict):
        self.folder, self.env = folder, env
        self.gcs = self.dashboard = None

    def ray(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run(
            ["ray", *args], cwd=self.folder, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, f"ray {' '.join(args)}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        return done.stdout + done.stderr

    def start_head(self, cpus: int) -> None:
        self.gcs, self.dashboard, client, *agents = free_ports(7)
        self.ray(
            "start", "--head", f"--num-cpus={cpus}", f"--port={self.gcs}", f"--dashboard-port={self.dashboard}",
            f"--ray-client-server-port={client}", *self._node_ports(agents), "--disable-usage-stats",
        )

    def add_node(self, cpus: int) -> int:
        """Start a node that joins the head; returns its raylet's port, which names it."""
        node_manager, object_manager, *agents = free_ports(6)
        self.ray(
            "start", f"--address=127.0.0.1:{self.gcs}", f"--num-cpus={cpus}",
            f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
            *self._node_ports(agents),
        )
        return node_manager

    @staticmethod
    def _node_ports(ports: list[int]) -> list[str]:
        agent_http, agent_grpc, metrics, env_agent = ports
        return [
            f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={env_agent}",
            # Workers of nodes sharing this machine bind where the OS puts them, so they never collide.
            "--object-store-memory=100000000", "--min-worker-port=0", "--max-worker-port=0",
        ]

    def lose_node(self, node_manager_port: int) -> None:
        """SIGKILL the node's raylet and every process under it, as a machine that dies."""
        raylets = [
            int(entry.name)
            for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and _is_raylet_of(entry, node_manager_port)
        ]
        assert len(raylets) == 1, f"one raylet on port {node_manager_port}, found {raylets}"
        for pid in [*descendants(raylets[0]), raylets[0]]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    def submit(self, command: str) -> str:
        """Submit `python -m raysb train ...` as a Ray job without waiting; returns its id."""
        printed = self.ray(
            "job", "submit", "--address", f"http://127.0.0.1:{self.dashboard}", "--working-dir", ".",
            "--no-wait", "--", *command.split(),
        )
        return re.search(r"raysubmit_\w+", printed).group(0)

    def wait_for_job(self, job_id: str, timeout_s: float) -> tuple[str, str]:
        """(final status, logs) of the job, once it is no longer running."""
        from ray.job_submission import JobStatus, JobSubmissionClient

        jobs = JobSubmissionClient(f"http://127.0.0.1:{self.dashboard}")
        deadline = time.monotonic() + timeout_s
        while jobs.get_job_status(job_id) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still running after {timeout_s}s:\n{jobs.get_job_logs(job_id)[-3000:]}")
            time.sleep(1)
        return jobs.get_job_status(job_id).value, jobs.get_job_logs(job_id)

    def wait_for_log(self, job_id: str, pattern: str, timeout_s: float) -> re.Match:
        """The first match of `pattern` in the running job's logs, once it is there."""
        from ray.job_submission import JobStatus, JobSubmissionClient

        jobs = JobSubmissionClient(f"http://127.0.0.1:{self.dashboard}")
        deadline = time.monotonic() + timeout_s
        while (found := re.search(pattern, jobs.get_job_logs(job_id))) is None:
            running = jobs.get_job_status(job_id) in (JobStatus.PENDING, JobStatus.RUNNING)
            assert running and time.monotonic() < deadline, f"job {job_id}: no {pattern!r} " \
                f"({f'after {timeout_s}s' if running else 'and it ended'}):\n{jobs.get_job_logs(job_id)[-3000:]}"
            time.sleep(1)
        return found


def _is_raylet_of(process: Path, node_manager_port: int) -> bool:
    try:
        command = (process / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return command[0].endswith(b"/raylet") and f"--node_manager_port={node_manager_port}".encode() in command


def wait_for_checkpoint(out: Path, after: int = 0, timeout_s: float = 300) -> int:
    """The epoch of the run's first committed checkpoint after epoch `after`, once there is one."""
    committed = out / "last_checkpoint.json"
    deadline = time.monotonic() + timeout_s
    while not committed.exists() or json.loads(committed.read_text())["epoch"] <= after:
        assert time.monotonic() < deadline, f"no checkpoint after epoch {after} committed in {out} after {timeout_s}s"
        time.sleep(0.2)
    return json.loads(committed.read_text())["epoch"]


@contextmanager
def local_cluster(tmp_path: Path) -> Iterator[tuple[LocalCluster, Path]]:
    """A LocalCluster on a copy of this checkout (and that copy's folder), with no node started yet;
    its Ray processes are killed when the block ends."""
    work = checkout_copy(tmp_path / "clone")
    home = tmp_path / "home"
    home.mkdir()
    env = environment_for_a_new_ray()
    with tempfile.TemporaryDirectory(prefix="rn", dir="/tmp") as ray_temp:  # Ray's socket paths stay short
        env.update(HOME=str(home), RAY_TMPDIR=ray_temp, PATH=f"{work / '.venv' / 'bin'}:{env['PATH']}",
                   # A lost node is declared dead after 3 missed health checks a second apart, not
                   # Ray's default 5 three seconds apart: the tests wait for that.
                   RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3")
        try:
            yield LocalCluster(work, env), work
        finally:
            stop_ray_of(Path(ray_temp))


def epochs_recorded(out: Path) -> list[int]:
    return [row["epoch"] for row in pq.read_table(out / "metrics.parquet").to_pylist()]


@needs_fashion_mnist
def test_a_job_on_two_nodes_resumes_on_a_replacement_node_then_stops_with_a_clear_error(tmp_path):
    """One job meets both losses: a node lost and replaced (Ray Train restarts the group on the
    head and the new node from the last checkpoint, inside the same job, and trains on), then the
    replacement lost with none to follow. That --resume then continues a Ray Train run from its
    last checkpoint is tests/test_distributed.py's (test_ctrl_c_...), on one node."""
    with local_cluster(tmp_path) as (cluster, work):
        cluster.start_head(cpus=1)
        second = cluster.add_node(cpus=1)
        out = work / "runs" / "replaced"
        # Failures to spare: the first is the loss the replacement answers; after the second the
        # group cannot be placed again, and its placement timeout is what ends the run. The third
        # is for a worker that dies as the group restarts after the loss, as one did in one CI run
        # (raysb.distributed.ray_internals.failure_policy_restarting_failed_starts).
        job = cluster.submit(f"python -m raysb train {RUN} --max-failures 3 --placement-timeout 10 --out {out}")
        lost_after = wait_for_checkpoint(out)
        cluster.lose_node(second)
        third = cluster.add_node(cpus=1)
        resumed = cluster.wait_for_log(job, r"raysb: resumed from the checkpoint after epoch (\d+)", timeout_s=300)
        resumed_from = int(resumed[1])
        assert resumed_from >= lost_after >= 1
        trained_on = wait_for_checkpoint(out, after=resumed_from)
        cluster.lose_node(third)
        status, logs = cluster.wait_for_job(job, timeout_s=300)
        assert status == "FAILED", logs[-4000:]
        # Both groups spanned two nodes: the first the head and the lost node, the second the
        # head and its replacement.
        assert logs.count("raysb: 2 worker(s) on 2 Ray node(s)") == 2, logs[-4000:]
        assert "raysb: error: Ray could not place the 2 workers (1 CPU each) within --placement-timeout 10s; " \
            "the cluster now has 1 CPUs" in logs, logs[-4000:]
        epoch = json.loads((out / "last_checkpoint.json").read_text())["epoch"]
        assert epoch >= trained_on and f"the checkpoint after epoch {epoch} is intact; once the cluster " \
            "has room for them, rerun with --resume to continue." in logs
        # Every epoch once: the rows written after the first checkpoint, before the loss, were redone.
        epochs = epochs_recorded(out)
        assert epochs == list(range(1, len(epochs) + 1)) and len(epochs) >= trained_on


@needs_fashion_mnist
def test_four_workers_spread_over_three_nodes_lose_one_and_end_where_an_uninterrupted_run_ends(tmp_path):
    """Three nodes of 2 CPUs: SPREAD places 4 workers on all three (PACK would fill two), so losing
    one leaves room for the whole group on the other two. Ray Train restarts it there from the last
    checkpoint, inside the same job, and the run ends exactly where the same run on an unbroken
    cluster ends: the resume path promises the same decisions, so the same error to the digit."""
    # About a second an epoch: the node is lost seconds after the first checkpoint, epochs before the end.
    epochs = 8
    run = (f"--workers 4 --placement-strategy SPREAD --dataset fashion-mnist --subset 3000 --test-subset 500 "
           f"--epochs {epochs} --progress-seconds 0 --max-failures 2 --placement-timeout 60")
    with local_cluster(tmp_path) as (cluster, work):
        cluster.start_head(cpus=2)
        doomed = cluster.add_node(cpus=2)
        cluster.add_node(cpus=2)
        unbroken, broken = work / "runs" / "unbroken", work / "runs" / "lost-a-node"
        status, logs = cluster.wait_for_job(cluster.submit(f"python -m raysb train {run} --out {unbroken}"), 600)
        assert status == "SUCCEEDED" and "raysb: 4 worker(s) on 3 Ray node(s)" in logs, logs[-4000:]

        job = cluster.submit(f"python -m raysb train {run} --out {broken}")
        lost_after = wait_for_checkpoint(broken)
        assert lost_after < epochs, "the run ended before the node could be lost: give it more epochs"
        cluster.lose_node(doomed)
        status, logs = cluster.wait_for_job(job, timeout_s=600)
        assert status == "SUCCEEDED", logs[-4000:]
        resumed_from = int(re.search(r"raysb: resumed from the checkpoint after epoch (\d+)", logs)[1])
        assert resumed_from >= lost_after
        assert logs.index("raysb: 4 worker(s) on 3 Ray node(s)") < logs.index("raysb: 4 worker(s) on 2 Ray node(s)")

        assert epochs_recorded(broken) == list(range(1, epochs + 1))
        # The closing line names the file that says where the checkpoints are.
        assert f"{broken}: metrics.parquet, summary.json, best_model.pt, last_checkpoint.json" in logs, logs[-2000:]
        ends = [json.loads((out / "summary.json").read_text()) for out in (unbroken, broken)]
        assert ends[1]["final_test_error"] == ends[0]["final_test_error"]
        assert ends[1]["backprop_examples"] == ends[0]["backprop_examples"]
        assert pq.read_table(broken / "metrics.parquet").column("test_loss").to_pylist() == \
            pq.read_table(unbroken / "metrics.parquet").column("test_loss").to_pylist()
