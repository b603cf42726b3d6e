import re
from pathlib import Path

import pytest
import torch

from raysb.cli import build_parser, config_from_args
from raysb.config import ConfigError, TrainConfig

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_selectivity_or_beta_and_stale_defaults():
    assert TrainConfig(beta=2).selectivity == pytest.approx(1 / 3)
    assert TrainConfig(selectivity=0.25).beta == pytest.approx(3)
    assert TrainConfig(strategy="stale-sb").staleness == 3
    assert TrainConfig(strategy="sb").staleness == 1


@pytest.mark.parametrize(
    "values, message",
    [
        ({"selectivity": 0}, "selectivity must be in"),
        ({"selectivity": -0.1}, "selectivity must be in"),
        ({"selectivity": 1.2}, "selectivity must be in"),
        ({"beta": -2}, "beta must be"),
        ({"beta": 2, "selectivity": 0.5}, "disagree; give one of them"),
        ({"staleness": 0, "strategy": "stale-sb"}, "staleness must be >= 1"),
        ({"staleness": 3, "strategy": "sb"}, "only applies to strategy stale-sb"),
        ({"history_size": 0}, "history_size must be >= 1"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"strategy": "greedy"}, "unknown strategy 'greedy'"),
        ({"lr_schedule": "step"}, "needs lr_milestones"),
        ({"lr_warmup_epochs": -1}, "lr_warmup_epochs must be a finite number >= 0"),
        ({"anneal_epochs": -1}, "anneal_epochs must be >= 0"),
        ({"keep_floor": 1.0}, "keep_floor must be in \\[0, 1\\)"),
        ({"collapse_patience": -1}, "collapse_patience must be >= 0"),
        ({"label_noise": 1.0}, "label_noise must be in"),
        ({"time_budget": 0}, "time_budget must be > 0"),
        ({"placement_timeout": 0}, "placement_timeout must be > 0 seconds"),
        ({"placement_strategy": "spread"}, "unknown placement_strategy 'spread'"),
        ({"selectivity": 1.0, "strategy": "kath18"}, "< 1 for kath18"),
        ({"epochs": "three"}, "epochs in test must be a whole number \\(or left out\\), got .three."),
        ({"selectivity": "abc"}, "selectivity in test must be a number \\(or left out\\), got .abc."),
        ({"bogus": 1}, "unknown key\\(s\\) in test: bogus"),
        ({"data_mode": "disk"}, "unknown data_mode 'disk'"),
        ({"data_mode": "stream", "workers": 2}, "data_mode=stream reads the raysb Parquet format"),
        ({"data_mode": "stream", "dataset": "parquet"}, "set workers"),
        ({"data_mode": "stream", "dataset": "parquet", "workers": 2, "subset": 100}, "subset work on in-memory"),
    ],
)
def test_bad_values_name_the_problem(values, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(values, source="test")


def test_saved_config_loads_back_identically(tmp_path):
    config = TrainConfig(strategy="stale-sb", beta=3, lr_schedule="step", lr_milestones=[2, 4])
    config.save(tmp_path / "config.yaml")
    assert TrainConfig.load(tmp_path / "config.yaml") == config


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    TrainConfig.load(path)


def test_cli_flags_override_set_which_overrides_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 5\nbeta: 2\nlr: 0.2\nmodel_options: {width: 16}\n")
    args = build_parser().parse_args(
        ["train", "--config", str(path), "--set", "lr=0.3", "--set", "epochs=7",
         "--set", "model_options.depth=4", "--epochs", "9", "--selectivity", "0.5",
         "--lr-milestones", "3,6"]
    )
    config = config_from_args(args)
    assert (config.epochs, config.lr, config.selectivity) == (9, 0.3, 0.5)
    assert config.model_options == {"width": 16, "depth": 4}
    assert config.lr_milestones == [3.0, 6.0]


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        TrainConfig.load(tmp_path / "nope.yaml")


def test_staleness_correction_is_on_where_scores_feed_later_steps():
    assert not TrainConfig().selection_spec().correct_staleness  # inline, selection batch = b: the paper's SB
    assert TrainConfig(selection_batch_size=512).selection_spec().correct_staleness
    assert TrainConfig(pipeline_selection="thread").selection_spec().correct_staleness
    assert not TrainConfig(selection_batch_size=512, staleness_correction="never").selection_spec().correct_staleness
    assert TrainConfig(staleness_correction="always").selection_spec().correct_staleness
    # N > 1 workers score 3 chunks of b between exchanges at s = 1/3; one worker trains as one process.
    assert TrainConfig(workers=2, selectivity=1 / 3).selection_spec().correct_staleness
    assert not TrainConfig(workers=1, selectivity=1 / 3).selection_spec().correct_staleness
    assert not TrainConfig(workers=2, strategy="traditional").selection_spec().correct_staleness
    assert not TrainConfig(workers=2, staleness_correction="never").selection_spec().correct_staleness
    with pytest.raises(ConfigError, match="staleness_correction"):
        TrainConfig(staleness_correction="on")


def test_a_global_batch_splits_over_the_workers_into_each_workers_batch():
    assert TrainConfig(workers=4, global_batch_size=128).batch_size == 32
    assert TrainConfig(workers=0, global_batch_size=128).batch_size == 128  # one worker, in this process
    assert TrainConfig(global_batch_size=96, batch_size=8).batch_size == 96  # one process: b is the whole step
    # The resolved record loads back to the same run (a resume reads config.yaml).
    again = TrainConfig.from_dict(TrainConfig(workers=4, global_batch_size=128).to_dict())
    assert (again.batch_size, again.global_batch_size) == (32, 128)
    with pytest.raises(ConfigError, match="global_batch_size 128 does not split evenly over 3 workers"):
        TrainConfig(workers=3, global_batch_size=128)


def test_by_default_workers_split_one_processs_batch_and_old_run_folders_keep_their_own():
    # issue 69's table: one process's step split over the workers ends where one process ends.
    assert [TrainConfig(workers=n).batch_size for n in (None, 0, 1, 2, 4, 8)] == [128, 128, 128, 64, 32, 16]
    # Workers that do not split it take the most each that they can; the record keeps b as resolved.
    assert TrainConfig(workers=3).batch_size == 42
    assert TrainConfig(workers=3).to_dict()["global_batch_size"] is None
    # Given, b is each worker's, as it always was: a run folder's config.yaml made before the default
    # split (batch_size 128, global_batch_size null, 4 workers) resumes at 128 a worker.
    made_before = TrainConfig().to_dict() | {"workers": 4, "batch_size": 128}
    assert TrainConfig.from_dict(made_before).batch_size == 128
    assert TrainConfig(workers=4, batch_size=16).batch_size == 16
    # A resolved record reads back to the same b, whatever the workers.
    for workers in (None, 2, 3, 4):
        resolved = TrainConfig(workers=workers).to_dict()
        assert TrainConfig.from_dict(resolved).to_dict() == resolved
    with pytest.raises(ConfigError, match="batch_size"):
        TrainConfig(batch_size=0)


def test_lockstep_ranks_exchange_about_a_batch_of_kept_examples_each():
    def rounds(workers=2, **values):
        return TrainConfig(batch_size=128, workers=workers, **values).selection_spec().rounds_per_exchange

    assert rounds(strategy="sb", selectivity=1 / 3) == 3  # 128 / (1/3 x 128)
    # One worker and one process queue each chunk's keeps at once: nobody to exchange with.
    assert rounds(workers=1, strategy="sb", selectivity=1 / 3) == rounds(workers=0, strategy="sb") == 1
    assert rounds(strategy="stale-sb", selectivity=0.25) == rounds(strategy="uniform", selectivity=0.25) == 4
    assert rounds(strategy="sb", selectivity=1 / 3, selection_batch_size=384) == 1
    assert rounds(strategy="sb", selectivity=0.5, selection_batch_size=1024) == 1  # never below one
    assert rounds(strategy="traditional") == rounds(strategy="kath18") == 1  # a batch a chunk already


def test_every_name_the_config_accepts_has_an_implementation():
    from raysb.config import SELECTION_BATCHNORMS, SELECTION_COMPILE_MODES, SELECTION_PRECISIONS
    from raysb.core.strategy_table import STRATEGIES
    from raysb.training.selection.strategies import build_strategy
    from raysb.training.selection.scoring import BATCHNORM_MODES, COMPILE_MODES, PRECISIONS

    specs = [TrainConfig(strategy=name, selectivity=0.25).selection_spec() for name in STRATEGIES]
    ids = torch.arange(100)
    assert [build_strategy(spec, sample_ids=ids).name for spec in specs] == list(STRATEGIES)
    assert list(PRECISIONS) == list(SELECTION_PRECISIONS)
    assert list(BATCHNORM_MODES) == list(SELECTION_BATCHNORMS)
    assert list(COMPILE_MODES) == list(SELECTION_COMPILE_MODES)


def test_parquet_columns_name_known_roles_of_parquet_data_only():
    assert TrainConfig(dataset="parquet", parquet_columns={"image": "pixels"}).parquet_columns == {"image": "pixels"}
    with pytest.raises(ConfigError, match="parquet_columns key"):
        TrainConfig(dataset="parquet", parquet_columns={"pixels": "image"})
    with pytest.raises(ConfigError, match="parquet_columns.label must be a column name"):
        TrainConfig(dataset="parquet", parquet_columns={"label": ""})
    with pytest.raises(ConfigError, match="not of 'fashion-mnist'"):
        TrainConfig(parquet_columns={"image": "pixels"})


def test_a_null_in_a_config_file_is_named_with_its_file(tmp_path):
    # `strategy:` with nothing after it is YAML's null: it once said "strategy must be a string, got None".
    path = tmp_path / "run.yaml"
    path.write_text("strategy:\nepochs: 2\n")
    with pytest.raises(ConfigError, match=re.escape(f"strategy in {path} must be a string, got null (leave the key "
                                                    "out for its default)")):
        TrainConfig.load(path)
    path.write_text("workers:\nepochs: 2\n")  # a key that takes None takes null
    assert TrainConfig.load(path).workers is None
