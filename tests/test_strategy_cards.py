"""A strategy is one file and one row: its class, and its card (raysb.core.strategy_card) in the
table (raysb.core.strategy_table) or, for a user's own, in their module. The cards agree with
what the classes build, the config's checks read them, and a strategy defined only in a test
module (tests/halving_strategy.py) runs through `raysb train`, the budget bench and a report."""

import ast
import json
import re

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from raysb.cli import main
from raysb.config import ConfigError, TrainConfig
from raysb.core.spec import SelectionSpec
from raysb.core.strategy_table import STRATEGIES, strategy_card
from raysb.training.selection.merged_histogram import MergedLossHistogram
from raysb.training.selection.strategies import build_strategy, strategy_class

from conftest import needs_fashion_mnist

OWN = "halving_strategy:HALVING"
# Read from the table, so that a strategy or a setting added there fails no case here that is not about it.
WITHOUT_OPTIONS = next(name for name, card in STRATEGIES.items() if card.selects and not card.options)
KEEPING_A_FRACTION = ", ".join(name for name, card in STRATEGIES.items() if card.keeps_fraction)


@pytest.mark.parametrize("name", [*STRATEGIES, OWN])
def test_every_card_builds_a_strategy_that_does_what_the_card_says(name):
    card = strategy_card(name)
    assert name == OWN or card.name == name
    # On lockstep ranks where the card lets it run on them, else refused there in one line.
    if card.lockstep_refusal is not None:
        with pytest.raises(ConfigError, match=re.escape(f"strategy {name} {card.lockstep_refusal}")):
            TrainConfig(strategy=name, workers=2)
    spec = TrainConfig(strategy=name, selectivity=0.25, workers=2 if card.lockstep_refusal is None else 1).selection_spec()
    history = MergedLossHistogram(spec.history_size, world_size=2)
    strategy = build_strategy(spec, history=history, sample_ids=torch.arange(100))
    assert type(strategy) is strategy_class(card) and strategy.name == card.name
    # Ranked on the ranks' shared CDF_R only where the card says so.
    assert (getattr(strategy.selector, "history", None) is history) == card.shared_cdf
    # A loss table, found by sample id, only where the card says a user's loop needs ids.
    assert (strategy.loss_table() is not None) == card.needs_sample_ids
    # Margins kept (label_suspects.parquet, the report's doubted labels) only where the card says so.
    assert bool(getattr(strategy.loss_table(), "tracks_margins", False)) == card.margins_kept(spec.options)
    if isinstance(card.keeps_margins, str):  # the option that turns them on, set to a rule that is not off
        rule = next(choice for choice in card.options[card.keeps_margins].choices if choice not in ("off", "auto"))
        doubting = TrainConfig(strategy=name, selectivity=0.25, **{card.keeps_margins: rule}).selection_spec()
        doubter = build_strategy(doubting, history=MergedLossHistogram(doubting.history_size),
                                 sample_ids=torch.arange(100))
        assert doubter.loss_table().tracks_margins and card.margins_kept(doubting.options)
    # A kept-fraction schedule can set the fraction of just the strategies whose cards say so.
    try:
        strategy.set_selectivity(1, 0.5)
        schedulable = True
    except ValueError:
        schedulable = False
    assert schedulable == card.keeps_fraction
    assert card.scored_share(3) >= 0 and 0 < card.kept_share(0.25) <= 1


def test_one_card_is_the_random_subset_baseline_and_every_built_in_has_its_own_colour():
    assert [name for name, card in STRATEGIES.items() if card.random_subset] == ["uniform"]
    colours = [card.colour for card in STRATEGIES.values()]
    assert None not in colours and len(set(colours)) == len(colours)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"strategy": "sb", "staleness": 3}, "staleness=3 only applies to strategy stale-sb, not sb"),
        ({"strategy": "kath18", "selectivity": 1.0}, "selectivity must be < 1 for kath18 (B > b), got 1.0"),
        ({"strategy": "sb", "score_refresh_epochs": 2}, "score_refresh_epochs only applies to strategy free-sb, not sb"),
        ({"strategy": "uniform", "training_loss_refresh": True},
         "training_loss_refresh only applies to strategy stale-sb, not uniform"),
        ({"strategy": "traditional", "selection_weights": "unbiased"},
         "selection_weights unbiased only applies to strategy free-sb, not traditional"),
        ({"strategy": "sb", "stale_sb_schedule": "authors"}, "stale_sb_schedule authors only applies to strategy "
         "stale-sb, not sb"),
        ({"strategy": "sb", "kath18_reweight": True}, "kath18_reweight only applies to strategy kath18, not sb"),
        ({"strategy": "uniform", "kath18_tau_threshold": 0.5},
         "kath18_tau_threshold only applies to strategy kath18, not uniform"),
        ({"strategy": "free-sb", "infobatch_prune_ratio": 0.3},
         "infobatch_prune_ratio=0.3 only applies to strategy infobatch, not free-sb"),
        ({"strategy": "infobatch", "infobatch_delta": 1.5}, "infobatch_delta must be in (0, 1], got 1.5"),
        ({"strategy": "free-sb", "score_refresh_epochs": 0}, "score_refresh_epochs must be >= 1 epoch, got 0"),
        # A built-in without options of its own, whichever the table has.
        ({"strategy": WITHOUT_OPTIONS, "strategy_options": {"start": 1}},
         f"strategy_options start: not an option of strategy {WITHOUT_OPTIONS} (it has no options)"),
        ({"strategy": OWN, "strategy_options": {"stride": 3}},
         f"strategy_options stride: not an option of strategy {OWN} (its options are start)"),
        ({"strategy": OWN, "strategy_options": {"start": 2}}, "halving's start must be 0 or 1, got 2"),
        ({"strategy": "stale-sb", "stale_sb_schedule": "authors", "prime_epochs": 1},
         "stale_sb_schedule authors primes one epoch of its own (scored, the pass at epoch 0): leave prime_epochs at "
         "0, got 1"),
        ({"strategy": "kath18", "kept_fraction_schedule": "lr"}, "kept_fraction_schedule lr applies to the strategies "
         f"that keep a fraction ({KEEPING_A_FRACTION}), not kath18"),
        ({"strategy": OWN, "staleness": 2}, f"staleness=2 only applies to strategy stale-sb, not {OWN}"),
        ({"strategy": "greedy"}, f"unknown strategy 'greedy'; choose one of {', '.join(STRATEGIES)}, "
         "or your own as package.module:CARD"),
        ({"strategy": "halving_strategy:Halving"}, "strategy 'halving_strategy:Halving': halving_strategy has no "
         "StrategyCard Halving"),
        ({"strategy": "no_such_module:CARD"}, "strategy 'no_such_module:CARD': cannot import no_such_module"),
    ],
)
def test_a_strategy_s_settings_are_checked_as_its_card_says(values, message):
    with pytest.raises(ConfigError) as raised:
        TrainConfig(**values)
    assert str(raised.value).startswith(message)


def test_a_card_s_defaults_apply_to_its_runs_only():
    assert TrainConfig(strategy="stale-sb").staleness == 3
    assert TrainConfig(strategy="sb").staleness == TrainConfig(strategy=OWN).staleness == 1
    assert TrainConfig(strategy=OWN).strategy_options == {"start": 0}
    assert TrainConfig(strategy=WITHOUT_OPTIONS).strategy_options == {}


def test_a_strategy_s_own_option_reaches_its_class_from_a_config_and_from_your_own_loop():
    """Declared on the card alone (tests/halving_strategy.py): raysb has no key of its own for it."""
    from raysb import SelectiveBackprop

    spec = TrainConfig(strategy=OWN, strategy_options={"start": 1}).selection_spec()
    assert build_strategy(spec, history=None, sample_ids=None).start == 1
    # However a spec is made, it holds every option: the card's defaults under those given.
    assert SelectionSpec(strategy=OWN, batch_size=8, beta=2.0, selection_batch_size=8).options == {"start": 0}

    model = torch.nn.Linear(2, 1)
    rows = [{"id": torch.arange(start, start + 8), "x": torch.randn(8, 2)} for start in range(0, 32, 8)]
    trained = {}
    for start in (0, 1):
        sb = SelectiveBackprop(lambda m, batch: m(batch["x"]).squeeze(1) ** 2, 4, strategy=OWN,
                               strategy_options={"start": start}, id_column="id")
        trained[start] = torch.cat([batch.sample_ids for batch in sb.batches(model, rows)]).tolist()
    assert trained == {0: list(range(0, 32, 2)), 1: list(range(1, 32, 2))}
    with pytest.raises(ConfigError, match="not an option of strategy"):
        SelectiveBackprop(lambda m, batch: m(batch["x"]), 4, strategy=OWN, strategy_options={"stride": 3})


# A new setting of free-sb's, as its file and its row would add it: an option on its card, with its
# default and check, and its class reading it from spec.options.
NEW_OPTION_ON_THE_CARD = """
import dataclasses as _dataclasses

_free_sb = STRATEGIES["free-sb"]


def _patience_checks(spec) -> None:
    _free_sb.check(spec)
    if spec.options["refresh_patience"] < 1:
        raise ValueError(f"refresh_patience must be >= 1, got {spec.options['refresh_patience']!r}")


STRATEGIES["free-sb"] = _dataclasses.replace(
    _free_sb, options={**_free_sb.options, "refresh_patience": StrategyOption(2, "int")}, check=_patience_checks)
"""
NEW_OPTION_READ_BY_THE_CLASS = """
_build_before = FreeSBStrategy.build.__func__


def _build(cls, spec, *, history, sample_ids, device):
    strategy = _build_before(cls, spec, history=history, sample_ids=sample_ids, device=device)
    strategy.refresh_patience = spec.options["refresh_patience"]
    return strategy


FreeSBStrategy.build = classmethod(_build)
"""
NEW_OPTION_SCRIPT = """
import json
import torch
from raysb import SelectiveBackprop
from raysb.config import ConfigError, TrainConfig, parse_overrides
from raysb.training.selection.strategies import build_strategy


def refused(values):
    try:
        TrainConfig.from_dict(values, source="test")
    except ConfigError as error:
        return str(error)


given = TrainConfig.from_dict(parse_overrides(["strategy=free-sb", "refresh_patience=3"]), source="--set")
own_loop = SelectiveBackprop(lambda model, batch: model(batch["x"]), 8, strategy="free-sb", id_column="id",
                             refresh_patience=4)
print(json.dumps({
    "default": TrainConfig(strategy="free-sb").refresh_patience,
    "given": given.refresh_patience,
    "built": build_strategy(given.selection_spec(), sample_ids=torch.arange(10)).refresh_patience,
    "as_a_strategy_option": TrainConfig(strategy="free-sb", strategy_options={"refresh_patience": 5}).refresh_patience,
    "own_loop": own_loop.rounds.strategy.refresh_patience,
    "checked": refused({"strategy": "free-sb", "refresh_patience": 0}),
    "typed": refused({"strategy": "free-sb", "refresh_patience": "soon"}),
    "elsewhere": refused({"strategy": "sb", "refresh_patience": 3}),
}))
"""


def test_a_new_setting_of_a_built_in_strategy_touches_only_its_file_and_its_row(tmp_path):
    """No change to raysb's config, spec or settings: the copy run here differs from raysb in the
    strategy's row (raysb/core/strategy_table.py) and its class's file alone."""
    from test_config_keys import run_in_an_edited_copy

    found = run_in_an_edited_copy(tmp_path, {
        "core/strategy_table.py": lambda source: source + NEW_OPTION_ON_THE_CARD,
        "training/selection/strategies/free_sb.py": lambda source: source + NEW_OPTION_READ_BY_THE_CLASS,
    }, NEW_OPTION_SCRIPT)
    assert found == {
        "default": 2, "given": 3, "built": 3, "as_a_strategy_option": 5, "own_loop": 4,
        "checked": "refresh_patience must be >= 1, got 0",
        "typed": "refresh_patience in test must be a whole number, got 'soon'",
        "elsewhere": "refresh_patience=3 only applies to strategy free-sb, not sb",
    }


# The layers that run a strategy, and analysis, which draws it: none of them may know a built-in by
# name. The benchmarks and the search choose which runs to make, and name them (README, "Architecture").
KNOWS_NO_STRATEGY = ("raysb.core", "raysb.config", "raysb.resume", "raysb.data", "raysb.models", "raysb.training",
                     "raysb.distributed", "raysb.api", "raysb.analysis")
# The default strategy (its config key's declaration and SelectiveBackprop) and Traditional, the
# reference every comparison is measured against (analysis' baseline). label_doubt's "uniform" is its rule
# of that name (the doubted drawn at the uniform rate), not the strategy.
NAMED_ON_PURPOSE = {"raysb.core.settings": {"sb"}, "raysb.selective_backprop": {"sb"}, "raysb.core.label_doubt": {"uniform"},
                    "raysb.analysis.frontier": {"traditional"}, "raysb.analysis.report": {"traditional"},
                    "raysb.analysis.run_report": {"traditional"}}


def strategy_names_written(source: str) -> set[str]:
    """The built-in strategies `source` names in a string that is not a docstring."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in STRATEGIES
            and id(node) not in docstrings}


def test_a_built_in_strategy_is_named_only_in_its_own_file_and_its_row():
    from test_layers import modules_and_sources

    named = {}
    for module, source in modules_and_sources():
        own = {module.rpartition(".")[2].replace("_", "-")} if module.startswith(STRATEGY_FILES) else set()
        if module == "raysb.core.strategy_table" or not module.startswith(KNOWS_NO_STRATEGY + ("raysb.selective",)):
            continue
        extra = strategy_names_written(source) - own - NAMED_ON_PURPOSE.get(module, set())
        if extra:
            named[module] = sorted(extra)
    assert named == {}
    assert strategy_names_written('"""sb"""\nDEFAULT = "sb"\n') == {"sb"}
    assert strategy_names_written('def f():\n    """kath18"""\n') == set()


STRATEGY_FILES = "raysb.training.selection.strategies."


@pytest.mark.parametrize("strategy, own, message", [
    ("sb", {"staleness": 3}, "staleness=3 only applies to strategy stale-sb, not sb"),
    ("sb", {"score_refresh_epochs": 2}, "score_refresh_epochs only applies to strategy free-sb, not sb"),
    ("uniform", {"training_loss_refresh": True}, "training_loss_refresh only applies to strategy stale-sb, not uniform"),
    (OWN, {"staleness": 2}, f"staleness=2 only applies to strategy stale-sb, not {OWN}"),
])
def test_your_own_loop_checks_a_strategy_s_settings_as_raysb_train_does(strategy, own, message):
    """One check for both: SelectiveBackprop once defaulted staleness to 3, which `raysb train` refuses for sb."""
    from raysb import SelectiveBackprop

    loss = lambda model, batch: model(batch[0])  # noqa: E731
    with pytest.raises(ConfigError) as raised:
        SelectiveBackprop(loss, 8, strategy=strategy, id_column="id", **own)
    assert str(raised.value) == message
    with pytest.raises(ConfigError) as raised:
        TrainConfig(strategy=strategy, **own)
    assert str(raised.value) == message
    # Stale-SB's staleness is its option, with its card's default, and not one of SB's.
    assert SelectiveBackprop(loss, 8, strategy="stale-sb", id_column="id").rounds.spec.options["staleness"] == 3
    assert "staleness" not in SelectiveBackprop(loss, 8, strategy="sb").rounds.spec.options


@needs_fashion_mnist
@pytest.mark.slow
def test_a_strategy_and_a_model_defined_in_test_modules_train_on_two_workers_run_the_bench_and_are_reported(
        ray_session, tmp_path, capsys):
    from raysb.bench.__main__ import main as bench

    from test_metric_sinks import tensorboard_scalars

    small = {"subset": 512, "test_subset": 200, "batch_size": 32, "model_options": {"width": 4},
             "lr_warmup_epochs": 0.25, "progress_seconds": 0, "collapse_patience": 0}
    run = tmp_path / "run"
    # On 2 Ray Train workers, which start where this folder is not on their path: the card and the
    # class go to them by value, and so does the model's factory (tests/test_own_model.py's).
    # Rank 0 alone writes the TensorBoard rows.
    own_model = {"model": "test_own_model:two_layer_net", "model_options": {"hidden": 24}, "log_to": ["tensorboard"]}
    assert main(["train", "--strategy", OWN, "--epochs", "2", "--workers", "2", "--out", str(run),
                 "--set", "strategy_options.start=1",
                 *[f"--set={key}={json.dumps(value)}" for key, value in {**small, **own_model}.items()]]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["config"]["strategy"] == OWN and summary["workers"] == 2
    assert summary["config"]["strategy_options"] == {"start": 1}
    rows = pq.read_table(run / "metrics.parquet").to_pylist()
    # Every other example of each chunk of 32: exactly half of each epoch's 512.
    assert [row["backprop_examples"] for row in rows] == [256, 512]
    assert rows[-1]["selection_forward_examples"] == 0
    (events,) = (run / "tensorboard").glob("events.out.tfevents.*")
    assert tensorboard_scalars(events.parent)["test_error"] == {
        row["epoch"]: pytest.approx(row["test_error"]) for row in rows
    }

    bench_out = tmp_path / "bench"
    bench(["--budgets", "1", "--epochs", "1", "--strategies", "traditional", OWN, "--out", str(bench_out),
           *[f"--set={key}={json.dumps(value)}" for key, value in {**small, "record_analysis": False}.items()]])
    runs = pd.read_csv(bench_out / "budget_runs.csv")
    assert list(runs["strategy"]) == ["traditional", OWN] and set(runs["status"]) == {"work_budget_reached"}
    # The same work, no scoring in either: the same examples trained, over more epochs of half the data.
    assert runs["backprop_examples"].nunique() == 1 and runs["epochs"].iloc[1] > runs["epochs"].iloc[0]
    assert f"| {OWN} |" in (bench_out / "report.md").read_text()

    assert main(["report", str(run)]) == 0
    report = (run / "report" / "report.md").read_text()
    assert OWN in report
    assert "wrote report.md" in capsys.readouterr().out
