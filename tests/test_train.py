"""End-to-end single-process runs on a real Fashion-MNIST subset."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from raysb.api import train
from raysb.cli import main
from raysb.config import TrainConfig
from raysb.core.errors import NonFiniteLossError
from raysb.training.engine import Engine
from raysb.training.run_schedule import RunSchedule
from raysb.training.outputs import METRIC_COLUMNS

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
pytestmark = pytest.mark.skipif(
    not FASHION_MNIST.is_dir(), reason="needs Debian's dataset-fashion-mnist package"
)


def small_config(tmp_path, **overrides) -> TrainConfig:
    values = dict(
        dataset="fashion-mnist",
        subset=3000,
        test_subset=1000,
        epochs=3,
        batch_size=32,
        lr=0.05,
        # Three short epochs: a full epoch of backprop warmup would leave SB (a third
        # of the data per epoch) still warming up at the end.
        lr_warmup_epochs=0.25,
        model_options={"width": 8},
        out=str(tmp_path / "run"),
    )
    values.update(overrides)
    return TrainConfig.from_dict(values)


def test_sb_run_learns_and_writes_every_output(tmp_path):
    result = train(small_config(tmp_path, strategy="sb", selectivity=0.33), log=lambda _: None)
    out = Path(result.out_dir)
    table = pq.read_table(out / "metrics.parquet").to_pylist()
    assert set(METRIC_COLUMNS) <= set(table[0])
    assert [row["epoch"] for row in table] == [1, 2, 3]
    # chance is 90% error; three short epochs of SB must get well below it
    assert table[-1]["test_error"] < 0.5
    assert table[-1]["test_error"] < table[0]["test_error"] - 0.1
    for column in ("wall_s", "backprop_examples", "optimizer_steps", "selection_forward_examples"):
        values = [row[column] for row in table]
        assert values == sorted(values), f"{column} must be cumulative"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed"
    # While the loss falls fast, new losses rank low against the last R and fewer are
    # kept; as training settles the kept fraction approaches the target (three short
    # epochs end at about 0.29 while the loss still falls).
    assert 0.2 < summary["kept_fraction"] < 0.36
    assert table[-1]["kept_fraction"] == pytest.approx(0.33, abs=0.05)
    assert table[-1]["kept_fraction"] > table[0]["kept_fraction"]
    # every backpropagated example was trained on in a full batch of b
    assert summary["backprop_examples"] == 32 * summary["optimizer_steps"]
    # SB scores every example every epoch
    assert summary["selection_forward_examples"] == 3 * 3000
    # kept in = backpropagated + carried remainder
    assert summary["examples_kept"] == summary["backprop_examples"] + summary["unused_kept_examples"]
    assert TrainConfig.load(out / "config.yaml") == TrainConfig.from_dict(summary["config"])


def test_stale_sb_does_one_third_of_the_selection_forwards(tmp_path):
    sb = train(small_config(tmp_path / "sb", strategy="sb"), log=lambda _: None).summary
    stale = train(
        small_config(tmp_path / "stale", strategy="stale-sb", staleness=3), log=lambda _: None
    ).summary
    assert sb["selection_forward_examples"] == 3 * 3000
    assert stale["selection_forward_examples"] * 3 == sb["selection_forward_examples"]
    # What the passes cost is counted, not timed: a time on this shared machine failed it once under load.
    assert 0.2 < stale["kept_fraction"] < 0.36


def test_priming_and_annealing_train_on_everything_without_scoring(tmp_path):
    config = small_config(tmp_path, strategy="sb", epochs=4, prime_epochs=1, anneal_epochs=1)
    rows = train(config, log=lambda _: None).metrics
    assert [row["kept_fraction"] for row in (rows[0], rows[3])] == [1.0, 1.0]
    assert all(row["kept_fraction"] < 0.5 for row in rows[1:3])
    # only the two selective epochs in the middle score examples
    assert rows[-1]["selection_forward_examples"] == 2 * 3000


@pytest.mark.parametrize("strategy", ["sb", "free-sb"])
def test_selectivity_1_keeps_every_example(tmp_path, strategy):
    """--help and README say s in (0, 1]; s = 1 was once refused as "beta must be a finite number > 0, got 0.0"."""
    code = main(["train", "--dataset", "fashion-mnist", "--subset", "500", "--test-subset", "100", "--epochs", "2",
                 "--batch-size", "50", "--set", "model_options.width=8", "--strategy", strategy, "--selectivity", "1",
                 "--out", str(tmp_path / "run")])
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["kept_fraction"] == 1.0 and summary["backprop_examples"] == 2 * 500
    assert summary["selection_forward_examples"] == 0  # keeping everything needs no scores


def test_priming_and_annealing_that_cover_every_epoch_are_refused(capsys, tmp_path):
    """--anneal-epochs at least --epochs once trained everything without a word."""
    code = main(["train", "--strategy", "sb", "--epochs", "3", "--anneal-epochs", "3", "--out", str(tmp_path / "run")])
    assert code == 2
    assert capsys.readouterr().err == (
        "raysb: error: prime_epochs=0 and anneal_epochs=3 train on every example in all 3 epochs: sb would never "
        "select; give more epochs or fewer of those\n"
    )
    assert not (tmp_path / "run").exists()


def test_traditional_backprops_everything_and_kath18_keeps_b_per_step(tmp_path):
    trad = train(small_config(tmp_path / "t", strategy="traditional", epochs=1), log=lambda _: None)
    assert trad.summary["selection_forward_examples"] == 0
    assert trad.summary["examples_kept"] == 3000

    steps_seen = []
    original = Engine.train_step

    def spy(self, batch):
        steps_seen.append(len(batch))
        original(self, batch)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "train_step", spy)
        kath = train(
            small_config(tmp_path / "k", strategy="kath18", selectivity=0.25, epochs=2, kath18_tau_threshold=1.0001),
            log=lambda _: None,
        ).summary
    assert set(steps_seen) == {32}
    chunks_per_epoch = -(-3000 // 128)
    assert kath["optimizer_steps"] == 2 * chunks_per_epoch  # one batch of b per presample of B = b/s
    assert kath["kept_fraction"] == pytest.approx(0.25, abs=0.01)
    assert kath["selection_forward_examples"] > 0  # importance sampling switched on


def test_nan_loss_stops_with_epoch_and_step_and_keeps_finished_epochs(tmp_path, monkeypatch):
    monkeypatch.setattr(RunSchedule, "lr", lambda self: 0.05 if self.epoch == 0 else 1e30)
    config = small_config(tmp_path, strategy="sb")
    with pytest.raises(NonFiniteLossError, match=r"at epoch 2, (step|round) \d+"):
        train(config, log=lambda _: None)
    out = Path(config.out)
    assert [r["epoch"] for r in pq.read_table(out / "metrics.parquet").to_pylist()] == [1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "epoch 2" in summary["error"]


def test_time_budget_stops_early_and_still_evaluates(tmp_path):
    result = train(small_config(tmp_path, epochs=50, time_budget=1.0), log=lambda _: None)
    assert result.summary["status"] == "time_budget_reached"
    assert result.summary["epochs_completed"] < 50
    assert result.metrics[-1]["test_error"] < 0.9


def test_cli_prints_progress_and_writes_files(tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(
        ["train", "--dataset", "fashion-mnist", "--strategy", "sb", "--selectivity", "0.33",
         "--epochs", "2", "--subset", "1000", "--test-subset", "500", "--batch-size", "50",
         "--set", "model_options.width=8", "--progress-seconds", "1e-9", "--out", str(out)]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "  epoch   2/2" in printed and "of its examples" in printed  # progress inside the epoch
    assert "epoch   1/2" in printed and "epoch   2/2" in printed and "kept" in printed
    assert "| run so far:" in printed  # cumulative figures say so
    closing = printed.strip().splitlines()[-1]
    assert closing.startswith("raysb: completed after 2 epoch(s)") and "final test error" in closing
    assert f"{out}: metrics.parquet, summary.json" in closing
    assert {p.name for p in out.iterdir()} >= {"metrics.parquet", "summary.json", "config.yaml"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataset", "imagenet"], "unknown dataset"),
        (["--model", "vgg"], "unknown model"),
        (["--strategy", "topk"], "unknown strategy"),
        (["--selectivity", "1.5"], "selectivity must be in"),
        (["--beta", "-1"], "beta must be"),
        (["--strategy", "stale-sb", "--staleness", "0"], "staleness must be >= 1"),
        (["--subset", "100", "--batch-size", "500"], "larger than the 100 training examples"),
        (["--dataset", "cifar10", "--data-dir", "/nonexistent"], "cifar"),
        (["--set", "history_size=0"], "history_size must be >= 1"),
        (["--subset", "1000000"], "subset 1000000 is more than the 60000 training examples of fashion-mnist"),
        (["--subset", "5"], "subset 5 is fewer than one example for each of the 10 classes"),
        (["--dataset", "cifar10", "--download"], "--download was given, but downloading needs a folder"),
        (["--set", "bach_size=32"], "unknown key(s) in command line: bach_size (did you mean batch_size?)"),
    ],
)
def test_cli_bad_input_exits_with_a_clear_message(tmp_path, capsys, args, message):
    code = main(["train", "--epochs", "1", "--out", str(tmp_path / "bad"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("raysb: error:")
    assert message.lower() in err.lower()
    assert "Traceback" not in err


def test_a_malformed_config_file_names_the_file_and_line(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("strategy: sb\nepochs: [1\n")
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"raysb: error: {config} is not valid YAML at line ") and "Traceback" not in err


def test_a_diverging_plain_run_says_what_to_try(tmp_path):
    with pytest.raises(NonFiniteLossError, match="lower the learning rate or check the data and labels"):
        train(small_config(tmp_path, strategy="traditional", lr=1e6, lr_warmup_epochs=0), log=lambda _: None)


def test_version_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    from raysb.version import __version__

    assert capsys.readouterr().out.strip() == f"raysb {__version__}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert ("training batch size b, on each worker (default: 128 over --workers, so any number of workers takes "
            "one process's steps at the same --lr)") in help_text
    assert "(default: 0.05)" in help_text  # --lr's, from its key's declaration
    assert ("number of epochs (default: 10, or none beside a --time-budget or --work-budget, which then ends the "
            "run; given with one, whichever comes first ends it)") in help_text
    # What a newcomer looks for: their own network, their own Parquet's columns, object storage.
    assert "package.module:factory" in help_text and "parquet_columns" in help_text and "s3://" in help_text


def test_gradients_are_clipped_to_the_norm_asked_for(tmp_path):
    from raysb.data.prepare import prepare_data
    from raysb.data.shards import MemoryShard
    from raysb.training.builders import build_engine

    config = small_config(tmp_path, strategy="traditional", grad_clip_norm=0.01)
    engine = build_engine(config.settings(), MemoryShard(prepare_data(config.settings().data, config.batch_size)[0]),
                          torch.device("cpu"))
    engine.train_epoch(0)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in engine.model.parameters()]))
    assert norm <= 0.01 * 1.0001


def test_the_best_epochs_weights_are_kept_beside_the_last(tmp_path):
    from raysb.data.prepare import prepare_data
    from raysb.data.shards import MemoryShard
    from raysb.training.builders import build_engine

    config = small_config(tmp_path, strategy="sb", epochs=3)
    result = train(config, log=lambda _: None)
    train_data, test_data, _ = prepare_data(config.settings().data, config.batch_size)
    engine = build_engine(config.settings(), MemoryShard(train_data), torch.device("cpu"))
    engine.feed.scoring_model.load_state_dict(torch.load(Path(result.out_dir) / "best_model.pt", weights_only=True))
    assert engine.evaluation.evaluate(test_data, 1024)[0] == min(row["test_error"] for row in result.metrics)


def test_a_training_step_trains_in_train_mode_whatever_scoring_left_inside_a_wrapper():
    """DDP and torch.compile wrap the model; scoring sets the module inside to eval, and the
    wrapper's own flag still says training. The step must still normalize with batch statistics."""
    from test_data import make_dataset

    from raysb.data.shards import MemoryShard
    from raysb.training.builders import build_engine

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    config = TrainConfig(model_options={"width": 8}, batch_size=16, record_analysis=False, device="cpu")
    engine = build_engine(config.settings(), MemoryShard(make_dataset(n=64, num_classes=4)), torch.device("cpu"))
    engine.step.model = Wrapper(engine.model)
    engine.model.inner.eval()
    assert engine.model.training
    engine.train_step(engine.feed.load(torch.arange(16)))
    assert all(module.training for module in engine.model.modules())


def test_an_engine_without_the_collective_its_spec_needs_is_a_clear_error():
    from test_data import make_dataset

    from raysb.data.shards import MemoryShard
    from raysb.training.builders import build_engine

    # A 2-worker config's ranks exchange kept examples: an engine built for it alone would
    # queue them locally and drift from its peers' steps.
    config = TrainConfig(workers=2, model_options={"width": 8}, batch_size=16, record_analysis=False, device="cpu")
    with pytest.raises(ValueError, match="lockstep=True but a collective was not given"):
        build_engine(config.settings(), MemoryShard(make_dataset(n=64, num_classes=4)), torch.device("cpu"))


def test_the_header_names_a_selectivity_only_for_strategies_that_read_it(tmp_path):
    """Traditional's header once printed `selectivity 0.330`."""
    headers = {}
    for strategy in ("traditional", "sb"):
        lines = []
        train(small_config(tmp_path, strategy=strategy, subset=500, test_subset=100, epochs=1,
                           out=str(tmp_path / strategy)), log=lines.append)
        headers[strategy] = lines[0]
    assert "selectivity" not in headers["traditional"] and "model small-cnn, device cpu" in headers["traditional"]
    assert "model small-cnn, selectivity 0.333, device cpu" in headers["sb"]
