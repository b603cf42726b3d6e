"""`raysb tune`: a sweep file run as Ray Tune trials, each a full `raysb train` run.

Trials follow Ray's driver-function pattern: the Tune trainable is a small
function that runs one training (in its own process, or as a Ray Train
TorchTrainer of `resources.workers` workers) and passes every evaluated
epoch's (wall-clock, test error) on to Tune. Each trial writes the usual
run folder under DIR/trials/<trial>; when the sweep ends, those folders become
DIR/trials.parquet and the Pareto and speedup reports (raysb.analysis).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raysb.api import train
from raysb.distributed.cluster import (
    ClusterError,
    autoscaler_ceiling,
    check_paths_outlive_the_job,
    cluster_capacity,
    connect_ray,
    watch_cluster,
)
from raysb.distributed.console import relayed_log, relayed_console
from raysb.distributed.chaos import committed_epoch
from raysb.distributed.ray_internals import tune_older_output
from raysb.resume import CHECKPOINT_FILE
from raysb.training.progress import print_line
from raysb.training.outputs import STATUS_FILE, write_json
from raysb.tune.sweep import Sweep, expand_trials, trial_config, trial_name

TRIALS_FOLDER = "trials"
# What a Ray Train trial's driver function holds: it only waits on its TorchTrainer,
# whose workers hold the real resources (Tune refuses an empty request).
DRIVER_CPUS = 0.01


def run_sweep(sweep: Sweep, out_dir: str | Path, address: str | None = None,
              log: Callable[[str], None] = print_line) -> Path:
    """Run (or resume) every trial of `sweep`, then write trials.parquet and the reports into `out_dir`."""
    check_paths_outlive_the_job({"--out": str(out_dir)})
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sweep.source, out / "sweep.yaml")
    search_alg = _search_alg(sweep)  # a missing optional package fails before Ray starts
    # Trials' lines come through a relay the driver prints in order (below), not through Ray's
    # forwarding of their stdout, which prefixed them with colour codes and let a trial's last
    # lines arrive after the sweep's closing ones.
    connect_ray(address, log_to_driver=False)
    concurrency = schedulable_concurrency(sweep, log)
    with relayed_console(log) as console:
        _fit(sweep, out, concurrency, search_alg, console, log)

    statuses = trial_statuses(out)
    write_json(out / "sweep_summary.json", {"sweep": sweep.name, "trials": statuses})
    for name, status in statuses.items():
        if status["status"] in ("failed", "diverged"):
            log(f"raysb: trial {name} {status['status']}: {status['error']}")
    table = collect_trials(out, statuses)
    log(f"raysb: {table.num_rows} epoch rows from {len(statuses)} trial(s) in {out / 'trials.parquet'}")
    return out


def _fit(sweep: Sweep, out: Path, concurrency: int, search_alg, console, log: Callable[[str], None]) -> None:
    """Run the sweep's trials with Ray Tune, each sending its lines to `console`."""
    from ray import tune

    trainable = tune.with_resources(
        tune.with_parameters(_run_trial, sweep=sweep, out_dir=str(out), console=console), _trial_resources(sweep)
    )
    experiment = out / "tune" / sweep.name
    if tune.Tuner.can_restore(str(experiment)):
        log(f"raysb: resuming the sweep stored in {experiment}")
        tuner = tune.Tuner.restore(str(experiment), trainable, resume_unfinished=True, resume_errored=False)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=_param_space(sweep),
            tune_config=_tune_config(sweep, concurrency, search_alg),
            # raysb prints each trial's epoch lines itself; Tune's own tables would bury them.
            run_config=tune.RunConfig(storage_path=str(out / "tune"), name=sweep.name, verbose=0),
        )
    trials = len(expand_trials(sweep)) if sweep.search == "grid" else sweep.num_samples
    log(f"raysb: sweep {sweep.name}: {trials} trial(s), up to {concurrency} at once, {sweep.budget_s:g}s each")
    if sweep.train.get("lr_schedule_key", "auto") == "auto":
        log(f"raysb: each trial's lr schedule runs over its {sweep.budget_s:g}s budget (lr_schedule_key: time), "
            "so it has decayed when the budget ends; set lr_schedule_key in the sweep's train: to change that")
    # Tune's older console output keeps quiet at verbose=0, as README promises Ray's output is.
    with watch_cluster(
        f"sweep {sweep.name}",
        lambda: f"Finished trials' folders under {out} are intact; rerun the same `raysb tune` command "
        "once a cluster is up again to resume the sweep.",
    ), tune_older_output():
        tuner.fit()


def schedulable_concurrency(sweep: Sweep, log: Callable[[str], None]) -> int:
    """Trials that fit at once; a trial that can never fit is an error, not an endless wait."""
    now = cluster_capacity()
    cpus, gpus = autoscaler_ceiling(now) or now
    trial = _trial_resources(sweep)
    workers = sweep.resources["workers"]
    need_cpus = trial["CPU"] + (workers or 0) * sweep.resources["cpus_per_worker"]
    need_gpus = trial.get("GPU", 0.0) + (workers or 0) * sweep.resources["gpus_per_worker"]
    if need_cpus > cpus or need_gpus > gpus:
        raise ClusterError(
            f"one trial needs {need_cpus:g} CPU and {need_gpus:g} GPU but the Ray cluster has {cpus:g} CPU "
            f"and {gpus:g} GPU: no trial could ever start; lower resources in {sweep.source}"
        )
    fits = int(cpus // need_cpus)
    if need_gpus:
        fits = min(fits, int(gpus // need_gpus))
    if fits < sweep.max_concurrent_trials:
        log(f"raysb: {sweep.max_concurrent_trials} concurrent trials asked, {fits} fit this cluster; running {fits}")
    return max(1, min(fits, sweep.max_concurrent_trials))


def collect_trials(out: Path, statuses: dict[str, dict[str, Any]]) -> pa.Table:
    """DIR/trials.parquet: every trial folder's metric rows with its config and status columns."""
    tables = []
    for name, status in sorted(statuses.items()):
        folder = out / TRIALS_FOLDER / name
        if not (folder / "metrics.parquet").is_file():
            continue
        metrics = pq.read_table(folder / "metrics.parquet")
        config = json.loads((folder / "summary.json").read_text())["config"] if (folder / "summary.json").is_file() else {}
        columns = {"trial_id": name, "trial_status": status["status"]}
        columns.update({key: value for key, value in config.items() if _is_scalar(value) and key not in metrics.column_names})
        for key, value in columns.items():
            metrics = metrics.append_column(key, pa.array([value] * metrics.num_rows))
        tables.append(metrics)
    table = pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})
    pq.write_table(table, out / "trials.parquet")
    return table


def _run_trial(params: dict[str, Any], sweep: Sweep, out_dir: str, console) -> None:
    """The driver function of one trial (runs in a Ray Tune actor).

    It records its own status beside its outputs, so the sweep's account of
    every trial comes from disk and survives an interrupted or resumed sweep.
    """
    name, overrides = params["trial"]["name"], params["trial"]["overrides"]
    folder = Path(out_dir) / TRIALS_FOLDER / name
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / STATUS_FILE, {"status": "running", "error": None})
    try:
        summary = _train_trial(name, trial_config(sweep, overrides, out=str(folder)), console).summary
    except Exception as error:
        write_json(folder / STATUS_FILE, {"status": "failed", "error": f"{type(error).__name__}: {error}"})
        raise
    # A collapsed model ends early with status "diverged": no budget is spent on it.
    status = "diverged" if summary["status"] == "diverged" else "completed"
    write_json(folder / STATUS_FILE, {"status": status, "error": summary.get("error")})


def _train_trial(name: str, config, console):
    from ray import tune

    relayed = relayed_log(console)
    log = lambda line: relayed(f"[{name}] {line}")  # noqa: E731
    if config.workers is None:
        torch.set_num_threads(max(1, int(config.cpus_per_worker)))
        # A trial restarted by a resumed sweep continues from its checkpoint, or starts over.
        config.resume = (Path(config.out) / CHECKPOINT_FILE).exists()
        config.overwrite = not config.resume
        return train(config, log, on_epoch=lambda row: tune.report({**row, "trial_name": name}))
    from ray.tune.integration.ray_train import TuneReportCallback

    from raysb.distributed.launch import train_distributed

    # A trial restarted by a resumed sweep continues its own Ray Train run, or starts over.
    config.resume = committed_epoch(config.out) > 0
    return train_distributed(config, log, callbacks=[TuneReportCallback()])


def trial_statuses(out: Path) -> dict[str, dict[str, Any]]:
    """Each trial folder's last recorded status; "stopped" where it never finished
    (a scheduler such as ASHA stopped it, or the sweep was interrupted)."""
    statuses = {}
    for path in sorted((out / TRIALS_FOLDER).glob(f"*/{STATUS_FILE}")):
        status = json.loads(path.read_text())
        if status["status"] == "running":
            status["status"] = "stopped"
        statuses[path.parent.name] = status
    return statuses


def _trial_resources(sweep: Sweep) -> dict[str, float]:
    if sweep.resources["workers"] is None:
        resources = {"CPU": float(sweep.resources["cpus_per_worker"])}
        if sweep.resources["gpus_per_worker"]:
            resources["GPU"] = float(sweep.resources["gpus_per_worker"])
        return resources
    return {"CPU": DRIVER_CPUS}


def _param_space(sweep: Sweep) -> dict[str, Any]:
    from ray import tune

    if sweep.search == "grid":
        return {"trial": tune.grid_search([{"name": trial_name(t), "overrides": t} for t in expand_trials(sweep)])}
    return {}


def _search_alg(sweep: Sweep):
    if sweep.search == "grid":
        return None
    from raysb.tune.optuna_search import optuna_search

    return optuna_search(sweep)


def _tune_config(sweep: Sweep, concurrency: int, search_alg):
    from ray import tune

    scheduler = None
    if sweep.scheduler == "asha":
        from ray.tune.schedulers import ASHAScheduler

        # Rungs in training seconds: trials are compared at equal wall-clock, the paper's axis.
        scheduler = ASHAScheduler(
            time_attr="wall_s", metric="test_error", mode="min",
            max_t=sweep.budget_s, grace_period=sweep.budget_s / 8, reduction_factor=2,
        )
    return tune.TuneConfig(
        max_concurrent_trials=concurrency,
        scheduler=scheduler,
        search_alg=search_alg,
        num_samples=sweep.num_samples if search_alg is not None else 1,
    )


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))
