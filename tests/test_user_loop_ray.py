"""SelectiveBackprop in a user's own Ray Train loop on 2 gloo workers: a user MLP, a
label-smoothed loss and user columns of several dtypes; equal steps on every rank,
no kept example lost, exact resume after a worker dies, then a NaN on one rank stopping both
(one fit: each Ray Train fit costs ~25 s of a 2-core machine's CPU, most of it Ray's own start)."""

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from raysb import NonFiniteLossError, SelectiveBackprop

import test_user_loop
from conftest import needs_fashion_mnist
from test_user_loop import ROWS, dict_batches, mlp, smoothed_ce

pytestmark = [needs_fashion_mnist, pytest.mark.slow]

EPOCHS = 3


def user_table() -> dict[str, torch.Tensor]:
    import torch.nn.functional as F

    from raysb.data import load_dataset

    data = load_dataset("fashion-mnist", "train")
    row = torch.arange(ROWS)
    return {
        "pixels": F.avg_pool2d(data.images[:ROWS].float() / 255, 4).flatten(1),
        "label": data.labels[:ROWS],
        "row": row,
        "weights": row.to(torch.float16) / 7,  # any name will do, internal ones too
        "tokens": torch.stack([row, -row], 1).to(torch.int32),
    }


def user_loop(config: dict) -> None:
    """What a user writes: their model, loss, data and checkpoints, with SB in the middle."""
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank = context.get_world_rank()
    record = Path(config["record"])
    table = user_table()
    # Rank 0 holds half the rows, rank 1 three eighths: ranks keep different numbers.
    rows = torch.arange(rank, ROWS, 2)
    rows = rows if rank == 0 else rows[: len(rows) * 3 // 4]

    model = ray.train.torch.prepare_model(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    epoch = 0

    def loss_fn(model, batch):
        losses = smoothed_ce(model, batch)
        # The NaN fault: from epoch `nan_epoch` on, rank 1's training forward (not its scoring) goes NaN.
        faulty = rank == 1 and epoch + 1 >= config.get("nan_epoch", math.inf) and torch.is_grad_enabled()
        return losses * float("nan") if faulty else losses

    sb = SelectiveBackprop(loss_fn, batch_size=16, selectivity=0.33, strategy=config["strategy"],
                           staleness=2 if config["strategy"] == "stale-sb" else None, id_column="row",
                           selection_batch_size=config.get("selection_batch_size"))
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            shared = torch.load(Path(folder) / "model.pt", weights_only=False)
            model.module.load_state_dict(shared["model"])
            optimizer.load_state_dict(shared["optimizer"])
            sb.load_state_dict(torch.load(Path(folder) / f"selection-rank{rank}.pt", weights_only=False))
            start = shared["epoch"]
    with open(record / "starts.txt", "a") as starts:
        starts.write(f"{rank}:{start}\n")

    for epoch in range(start, config.get("epochs", EPOCHS)):
        trained = []
        for batch in sb.batches(model, dict_batches(table, epoch, size=37, rows=rows)):
            for name, column in table.items():  # every column arrives whole, whichever rank kept it
                assert torch.equal(batch[name], column[batch["row"]]), name
            loss = sb.loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            trained.extend(batch["row"].tolist())
        metrics = sb.metrics()
        # Named by the epoch this worker group started from: a resumed group's records sit beside the first's.
        (record / f"epoch{epoch + 1}-rank{rank}-from{start}.json").write_text(json.dumps({"trained": trained, **metrics}))
        if rank == 0 and epoch + 1 == EPOCHS:
            torch.save(model.module.state_dict(), record / f"final-from{start}.pt")
        if config.get("die_unreported") == epoch + 1 and rank == 1 and not (record / "died").exists():
            # Die with this epoch trained but not reported, once Ray Train has committed the epoch
            # before: the new group resumes from that checkpoint and trains this epoch again.
            deadline = time.monotonic() + 60
            while not (record / f"committed-{epoch}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            (record / "died").touch()
            os._exit(1)
        with tempfile.TemporaryDirectory() as folder:
            torch.save(sb.state_dict(), Path(folder) / f"selection-rank{rank}.pt")
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch + 1}, Path(folder) / "model.pt")
            ray.train.report({"epoch": epoch + 1}, checkpoint=ray.train.Checkpoint.from_directory(folder))


def fit(tmp_path, name: str, **config):
    import ray.cloudpickle
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    # Ray workers cannot import the test modules: send the loop and its helpers by value.
    for module in (sys.modules[__name__], test_user_loop):
        ray.cloudpickle.register_pickle_by_value(module)
    record = tmp_path / name
    record.mkdir()

    class CommitRecorder(ray.train.UserCallback):
        """On the controller: a file per checkpoint Ray Train has committed."""

        def after_report(self, run_context, metrics, checkpoint) -> None:
            if checkpoint is not None:
                (record / f"committed-{metrics[0]['epoch']}").touch()

    trainer = TorchTrainer(
        user_loop,
        train_loop_config={"record": str(record), "strategy": "sb", **config},
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=ray.train.RunConfig(
            storage_path=str(tmp_path / "storage"), name=name,
            failure_config=ray.train.FailureConfig(max_failures=config.get("die_unreported") and 1 or 0),
            callbacks=[CommitRecorder()],
        ),
    )
    trainer.fit()
    return record


def epoch_record(record: Path, epoch: int, rank: int, start: int = 0) -> dict:
    """What `rank` trained in `epoch` and its counts after it, in the worker group that started at epoch `start`."""
    return json.loads((record / f"epoch{epoch}-rank{rank}-from{start}.json").read_text())


COUNTS = ("examples_kept", "backprop_examples", "selection_forward_examples", "optimizer_steps", "examples_considered")


def test_user_loop_keeps_ranks_in_lockstep_resumes_exactly_after_a_worker_dies_and_stops_both_ranks_on_a_nan(
        ray_session, tmp_path):
    import ray.train

    # Stale-SB: its loss table is shared across ranks; a 64-example selection batch feeds
    # several steps per round, so the staleness correction weights them.
    # Rank 1 dies with epoch 3 trained but not reported: the new group resumes from epoch 2's
    # checkpoint and must train epoch 3 again exactly as the first group did, on both ranks.
    # Then in epoch 4 rank 1's training loss goes NaN, with the one failure Ray Train may retry spent.
    with pytest.raises(ray.train.TrainingFailedError) as failed:
        fit(tmp_path, "run", strategy="stale-sb", selection_batch_size=64, die_unreported=EPOCHS, epochs=EPOCHS + 1,
            nan_epoch=EPOCHS + 1)
    run = tmp_path / "run"
    assert (run / "died").exists()
    assert sorted((run / "starts.txt").read_text().split()) == ["0:0", "0:2", "1:0", "1:2"]

    for epoch in range(1, EPOCHS + 1):
        ranks = [epoch_record(run, epoch, rank) for rank in (0, 1)]
        # Equal steps of exactly b on both ranks, however many each kept.
        assert ranks[0]["optimizer_steps"] == ranks[1]["optimizer_steps"] > 0
        assert len(ranks[0]["trained"]) == len(ranks[1]["trained"]) == 16 * ranks[0]["epoch_steps"]
        # No kept example lost: backpropagated by some rank, or still queued (the same queue on both).
        kept = ranks[0]["examples_kept"] + ranks[1]["examples_kept"]
        backprop = ranks[0]["backprop_examples"] + ranks[1]["backprop_examples"]
        assert kept == backprop + ranks[0]["unused_kept_examples"]
        assert ranks[0]["unused_kept_examples"] == ranks[1]["unused_kept_examples"]
    # Exact resume: what each rank trained on, and its counts, as if no worker had died.
    for rank in (0, 1):
        first, resumed = epoch_record(run, EPOCHS, rank), epoch_record(run, EPOCHS, rank, start=2)
        assert resumed["trained"] == first["trained"], rank
        assert {k: resumed[k] for k in COUNTS} == {k: first[k] for k in COUNTS}
    assert ranks[0]["examples_kept"] > ranks[1]["examples_kept"]
    # Epoch 2 reused epoch 1's losses: nothing was scored; epoch 3 scored again.
    assert [epoch_record(run, e, 1)["selection_forward_examples"] for e in (1, 2, 3)] == [450, 450, 900]
    first_final, resumed_final = torch.load(run / "final-from0.pt"), torch.load(run / "final-from2.pt")
    for name, value in first_final.items():
        assert torch.equal(value, resumed_final[name]), name

    # Both ranks stopped before the NaN reached a backward pass, each saying which rank stopped the run.
    failures = failed.value.worker_failures
    assert set(failures) == {0, 1} and all(isinstance(e, NonFiniteLossError) for e in failures.values())
    assert str(failures[1]) == (
        "training loss is not finite (here nan) at epoch 4, step 1; lower the learning rate or check the data and labels"
    )
    assert str(failures[0]) == "rank 1 stopped the run: " + str(failures[1])
    assert not (run / f"epoch{EPOCHS + 1}-rank0-from2.json").exists()
