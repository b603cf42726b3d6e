"""Sweep files: expansion into trials and the errors a bad file gets (no Ray needed)."""

from pathlib import Path

import pytest

from raysb.config import ConfigError, STRATEGIES
from raysb.tune.sweep import expand_trials, load_sweep, parse_sweep, trial_config, trial_name

SHIPPED = sorted(Path(__file__).resolve().parents[1].glob("tune_configs/*.yaml"))

BASE = """\
name: t
train:
  dataset: fashion-mnist
  epochs: 2
grid:
  seed: [0, 1]
variants:
  - strategy: traditional
  - strategy: sb
    selectivity: [0.5, 0.25]
  - strategy: stale-sb
    selectivity: 0.33
    staleness: [2, 3]
budget_s: 10
"""


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def test_variants_cross_the_grid_without_invalid_pairs(tmp_path):
    sweep = load_sweep(write(tmp_path, BASE))
    trials = expand_trials(sweep)
    # (1 traditional + 2 sb + 2 stale-sb) x 2 seeds; staleness never meets sb or traditional
    assert len(trials) == 10
    assert sum(t["strategy"] == "traditional" for t in trials) == 2
    assert {t.get("staleness") for t in trials if t["strategy"] != "stale-sb"} == {None}
    names = [trial_name(t) for t in trials]
    assert len(set(names)) == len(names)
    assert "stale-sb_seed=1_selectivity=0.33_staleness=3" in names
    config = trial_config(sweep, trials[-1], out=str(tmp_path / "x"))
    assert (config.strategy, config.staleness, config.time_budget, config.epochs) == ("stale-sb", 3, 10.0, 2)


def test_a_variant_selectivity_replaces_beta_from_train(tmp_path):
    sweep = load_sweep(write(tmp_path, BASE.replace("  epochs: 2\n", "  epochs: 2\n  beta: 2\n")))
    sb = [t for t in expand_trials(sweep) if t["strategy"] == "sb"][0]
    assert trial_config(sweep, sb, out="x").selectivity == 0.5


def test_a_variant_of_every_strategy_gives_each_the_keys_it_reads(tmp_path):
    """`strategy: all` is one variant per built-in strategy, so a sweep of every strategy holds one
    added to the table without an edit; a strategy that refuses selectivity (Traditional) runs without it."""
    sweep = load_sweep(write(tmp_path, BASE.replace("  - strategy: traditional\n", "  - strategy: all\n    lr: 0.2\n"
                                                                                  "    selectivity: [0.5, 0.25]\n")))
    every = [t for t in expand_trials(sweep) if t["seed"] == 0][:-4]  # the variants after it: sb's 2, stale-sb's 2
    for name, card in STRATEGIES.items():
        own = [t for t in every if t["strategy"] == name]
        reads = card.reads("selectivity")
        assert [t.get("selectivity") for t in own] == ([0.5, 0.25] if reads else [None]), name
        assert {t["lr"] for t in own} == {0.2}
        assert trial_config(sweep, own[0], out="x").strategy == name
    assert len(every) == sum(2 if card.reads("selectivity") else 1 for card in STRATEGIES.values())


@pytest.mark.parametrize(
    "edit, message",
    [
        (("name: t\n", "name: t\nbudget: 3\n"), r"unknown sweep key 'budget' \(.*line 2\)"),
        (("  epochs: 2\n", "  epochs: 2\n  epoch: 3\n"), r"unknown train config key 'epoch' in train \(.*line 5\)"),
        (("    staleness: [2, 3]\n", "    stalenes: [2, 3]\n"), r"unknown train config key 'stalenes' in variants\[2\] \(.*line 13\)"),
        (("budget_s: 10", "budget_s: 0"), r"budget_s must be a number of seconds > 0, got 0 \(.*line 14\)"),
        (("budget_s: 10", "budget_s: -5"), r"budget_s must be a number of seconds > 0"),
        (("budget_s: 10", "budget_s: soon"), r"budget_s must be a number of seconds > 0"),
        (("  seed: [0, 1]\n", "  seed: []\n"), r"grid.seed must be a non-empty list"),
        (("    selectivity: [0.5, 0.25]\n", "    selectivity: []\n"), r"variants\[1\].selectivity is an empty list"),
        (("  epochs: 2\n", "  epochs: 2\n  out: somewhere\n"), r"'out' in train .* is set by the sweep"),
        (("    selectivity: [0.5, 0.25]\n", "    selectivity: [0.5, 1.5]\n"), r"trial sb_seed=0_selectivity=1.5: selectivity must be in"),
        (("budget_s: 10", "budget_s: 10\nsearch: random"), r"unknown search 'random'"),
        (("budget_s: 10", "budget_s: 10\nscheduler: hyperband"), r"unknown scheduler 'hyperband'"),
        (("budget_s: 10", "budget_s: 10\nresources: {nodes: 3}"), r"unknown resources key\(s\) \['nodes'\]"),
        (("budget_s: 10", "budget_s: 10\nranges: {lr: [0.01, 0.1]}"), r"ranges .* need search: optuna"),
    ],
)
def test_bad_sweep_files_name_the_problem(tmp_path, edit, message):
    old, new = edit
    assert old in BASE
    with pytest.raises(ConfigError, match=message):
        load_sweep(write(tmp_path, BASE.replace(old, new, 1)))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="sweep file not found"):
        load_sweep(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_sweep(write(tmp_path, "train: [unclosed\n"))
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_sweep(write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="budget_s must be"):
        parse_sweep({"train": {}}, "inline")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_sweeps_are_valid(path):
    sweep = load_sweep(path)
    strategies = {t["strategy"] for t in expand_trials(sweep)}
    assert "traditional" in strategies, "speedups need a Traditional baseline"
    assert strategies <= set(STRATEGIES)


def test_the_smoke_sweep_holds_every_strategy_under_the_default_schedule():
    """It once swept the four old strategies under a static lr, without free-sb, InfoBatch and uniform."""
    sweep = load_sweep(Path(__file__).resolve().parents[1] / "tune_configs" / "smoke.yaml")
    trials = expand_trials(sweep)
    assert sorted(t["strategy"] for t in trials) == sorted(STRATEGIES)
    configs = [trial_config(sweep, t, out="unused") for t in trials]
    assert {(c.lr_schedule, c.lr_schedule_key) for c in configs} == {("cosine", "time")}
