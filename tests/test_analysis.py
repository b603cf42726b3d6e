import json
import math

import numpy as np
import pandas as pd
import pytest
import yaml

from raysb.analysis import AnalysisError
from raysb.analysis.frontier import pareto_mask, pareto_share, speedup_table, time_to_target
from raysb.analysis.report import write_pareto_report
from raysb.analysis.results import load_trials
from raysb.cli import main
from raysb.training.outputs import METRIC_COLUMNS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def metric_rows(curve):
    """Full metrics rows for a curve of (wall_s, test_error) pairs, epochs 1, 2, ..."""
    return [
        {**{column: 0 for column in METRIC_COLUMNS}, "epoch": epoch, "wall_s": wall_s, "test_error": error}
        for epoch, (wall_s, error) in enumerate(curve, start=1)
    ]


def trial_frame(curves):
    """{(strategy, trial_id): curve} -> trial rows with a couple of config columns."""
    return pd.DataFrame(
        [
            {"trial_id": trial_id, "strategy": strategy, "seed": seed, "selectivity": 0.33, **row}
            for seed, ((strategy, trial_id), curve) in enumerate(curves.items())
            for row in metric_rows(curve)
        ]
    )


# E = 0.10 (t1's final error); targets 1.1E = 0.11, 1.2E = 0.12, 1.4E = 0.14.
CURVES = {
    ("kath18", "k1"): [(4, 0.5), (8, 0.135)],
    ("sb", "s1"): [(5, 0.20), (10, 0.105), (15, 0.13)],  # falls below every target, then rises
    ("traditional", "t1"): [(10, 0.30), (20, 0.13), (30, 0.10)],
    ("sb", "s2"): [(6, 0.125), (12, 0.115), (18, 0.112)],
    ("traditional", "t2"): [(12, 0.25), (24, 0.118), (36, 0.105)],
    ("kath18", "k2"): [(3, 0.3), (9, 0.2)],
}


# -- pareto_mask ---------------------------------------------------------------


@pytest.mark.parametrize(
    "points, expected",
    [
        ([(1, 0.5), (2, 0.4), (3, 0.45), (2, 0.6)], [True, True, False, False]),  # dominance
        ([(1, 0.5), (1, 0.5), (2, 0.3)], [True, True, True]),  # exact duplicates stay
        ([(2, 0.3), (1, 0.5), (1, 0.5), (3, 0.3)], [True, True, True, False]),
        ([(1, 0.5), (1, 0.4)], [False, True]),  # same time, different error
        ([(1, 0.4), (2, 0.4)], [True, False]),  # same error, different time
        ([(math.nan, 0.1), (1, math.nan), (2, 0.5)], [False, False, True]),  # NaN never dominates
        ([(1, math.nan)], [False]),
        ([], []),
    ],
)
def test_pareto_mask_hand_worked(points, expected):
    times = [t for t, _ in points]
    errors = [e for _, e in points]
    assert pareto_mask(times, errors).tolist() == expected


def test_pareto_mask_matches_brute_force_with_ties():
    rng = np.random.default_rng(0)
    times = rng.integers(0, 8, 200).astype(float)
    errors = rng.integers(0, 8, 200).astype(float)
    dominated = [
        any(t2 <= t and e2 <= e and (t2 < t or e2 < e) for t2, e2 in zip(times, errors))
        for t, e in zip(times, errors)
    ]
    assert pareto_mask(times, errors).tolist() == [not d for d in dominated]


# -- time_to_target ------------------------------------------------------------


def test_time_to_target_first_crossing_of_non_monotone_curve():
    times, errors = [1, 2, 3, 4], [0.5, 0.2, 0.4, 0.1]
    assert time_to_target(times, errors, 0.3) == 2.0
    assert time_to_target(times, errors, 0.2) == 2.0  # <= counts
    assert time_to_target(times, errors, 0.6) == 1.0  # reached at the first point
    assert time_to_target(times, errors, 0.05) == math.inf


# -- speedup_table -------------------------------------------------------------


def test_speedup_table_hand_worked():
    table = speedup_table(trial_frame(CURVES)).set_index("strategy")
    assert list(table.index) == ["traditional", "sb", "kath18"]
    assert table["trials"].tolist() == [2, 2, 2]
    assert table["final_error"].tolist() == pytest.approx([0.10, 0.112, 0.135])
    # traditional: 1.1E by t1 at 30 s, 1.2E by t2 at 24 s, 1.4E by t1 at 20 s.
    assert table.loc["traditional", ["time_to_1.1E_s", "time_to_1.2E_s", "time_to_1.4E_s"]].tolist() == [30, 24, 20]
    assert table.loc["traditional", ["trial_1.1E", "trial_1.2E", "trial_1.4E"]].tolist() == ["t1", "t2", "t1"]
    assert table.loc["traditional", ["speedup_1.1E", "speedup_1.2E", "speedup_1.4E"]].tolist() == [1.0, 1.0, 1.0]
    # sb: s1 at 10 s for 1.1E and 1.2E (its later rise does not undo it); s2 at 6 s for 1.4E.
    assert table.loc["sb", ["speedup_1.1E", "speedup_1.2E", "speedup_1.4E"]].tolist() == pytest.approx(
        [30 / 10, 24 / 10, 20 / 6]
    )
    assert table.loc["sb", ["trial_1.1E", "trial_1.2E", "trial_1.4E"]].tolist() == ["s1", "s1", "s2"]
    # kath18 never reaches 1.1E or 1.2E; k1 reaches 1.4E at 8 s.
    assert math.isnan(table.loc["kath18", "speedup_1.1E"]) and math.isnan(table.loc["kath18", "time_to_1.2E_s"])
    assert pd.isna(table.loc["kath18", "trial_1.1E"])
    assert table.loc["kath18", "speedup_1.4E"] == pytest.approx(20 / 8)
    assert table.loc["kath18", "trial_1.4E"] == "k1"


def test_speedup_table_counts_an_error_exactly_at_the_target():
    trials = trial_frame({("traditional", "t"): [(10, 0.5), (20, 0.1)], ("sb", "s"): [(5, 0.11)]})
    assert speedup_table(trials, targets=(1.1,))["speedup_1.1E"].tolist() == [1.0, 4.0]


def test_speedup_table_without_baseline_names_found_strategies():
    trials = trial_frame({("sb", "s1"): [(1, 0.2)], ("kath18", "k1"): [(1, 0.3)]})
    with pytest.raises(AnalysisError, match="'traditional'.*strategies found: sb, kath18"):
        speedup_table(trials)


def test_pareto_share():
    trials = trial_frame({("zeta", "z"): [(1, 0.9)], ("sb", "s"): [(2, 0.5), (3, 0.6)], ("traditional", "t"): [(4, 0.4)]})
    share = pareto_share(trials)
    assert share["strategy"].tolist() == ["traditional", "sb", "zeta"]
    assert share["points"].tolist() == [1, 2, 1]
    assert share["pareto_points"].tolist() == [1, 1, 1]
    assert share["pareto_share"].tolist() == pytest.approx([1 / 3] * 3)


# -- load_trials ---------------------------------------------------------------


def write_sweep(folder, curves, extra_rows=()):
    folder.mkdir(parents=True)
    rows = trial_frame(curves).assign(trial_status="completed")
    rows = pd.concat([rows, pd.DataFrame(list(extra_rows))], ignore_index=True)
    rows.to_parquet(folder / "trials.parquet")
    return folder


def write_run(folder, strategy, curve, summary=True):
    folder.mkdir(parents=True)
    pd.DataFrame(metric_rows(curve)).to_parquet(folder / "metrics.parquet")
    config = {"strategy": strategy, "seed": 3, "lr_milestones": [60, 120], "model_options": {}, "lr_schedule": "static"}
    if summary:
        (folder / "summary.json").write_text(json.dumps({"status": "completed", "config": config}))
    else:
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder


def test_load_trials_from_sweep_and_run_folders(tmp_path):
    never_evaluated = {"trial_id": "t9", "strategy": "sb", "trial_status": "failed", "epoch": math.nan}
    sweep = write_sweep(tmp_path / "sweep", {("sb", "t2"): [(2, 0.3), (4, 0.2)], ("traditional", "t1"): [(3, 0.4)]},
                        [never_evaluated])
    run = write_run(tmp_path / "runs" / "trad", "traditional", [(5, 0.5), (9, 0.25)])
    yaml_run = write_run(tmp_path / "runs" / "live", "kath18", [(1, 0.6)], summary=False)
    trials = load_trials([sweep, run, yaml_run])
    assert list(zip(trials["trial_id"], trials["epoch"])) == [
        ("live", 1), ("t1", 1), ("t2", 1), ("t2", 2), ("trad", 1), ("trad", 2)
    ]
    trad = trials.loc[trials["trial_id"] == "trad"].iloc[0]
    assert (trad["strategy"], trad["seed"], trad["trial_status"]) == ("traditional", 3, "completed")
    assert "lr_milestones" not in trials.columns and "model_options" not in trials.columns
    assert trials.loc[trials["trial_id"] == "live", "strategy"].tolist() == ["kath18"]


def test_load_trials_prefixes_colliding_trial_ids(tmp_path):
    first = write_sweep(tmp_path / "a", {("sb", "t1"): [(1, 0.3)]})
    second = write_sweep(tmp_path / "b", {("sb", "t1"): [(1, 0.2)], ("sb", "t2"): [(1, 0.1)]})
    assert sorted(load_trials([first, second])["trial_id"]) == ["a/t1", "b/t1", "b/t2"]
    run_a = write_run(tmp_path / "x" / "sb", "sb", [(1, 0.3)])
    run_b = write_run(tmp_path / "y" / "sb", "sb", [(1, 0.3)])
    assert sorted(load_trials([run_a, run_b])["trial_id"]) == ["x/sb", "y/sb"]


def test_load_trials_errors(tmp_path):
    with pytest.raises(AnalysisError, match="nowhere does not exist"):
        load_trials([tmp_path / "nowhere"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(AnalysisError, match="empty is neither a sweep folder"):
        load_trials([tmp_path / "empty"])
    unfinished = write_sweep(tmp_path / "unfinished", {}, [{"trial_id": "t1", "strategy": "sb", "epoch": math.nan,
                                                          "wall_s": math.nan, "test_error": math.nan}])
    with pytest.raises(AnalysisError, match="no finished trials in .*unfinished"):
        load_trials([unfinished])


# -- report and CLI ------------------------------------------------------------


def assert_png(path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 1000


def test_write_pareto_report_writes_every_file(tmp_path):
    written = write_pareto_report(trial_frame(CURVES), tmp_path / "report")
    assert set(written) == {"pareto.csv", "pareto.png", "pareto_share.csv", "speedups.csv", "speedups.md", "curves.png"}
    assert all(path.is_file() for path in written.values())
    assert_png(written["pareto.png"])
    assert_png(written["curves.png"])
    frontier = pd.read_csv(written["pareto.csv"])
    assert list(frontier.columns[:5]) == ["trial_id", "strategy", "epoch", "wall_s", "test_error"]
    assert "seed" in frontier.columns and frontier["wall_s"].is_monotonic_increasing
    markdown = written["speedups.md"].read_text()
    assert "| strategy | final error | 1.1E | 1.2E | 1.4E |" in markdown
    assert "| kath18 | 13.50% | – | – | 2.50x |" in markdown
    assert "| sb | 11.20% | 3.00x | 2.40x | 3.33x |" in markdown
    assert "E = 10.00%" in markdown and "`t1`" in markdown
    assert pd.read_csv(written["speedups.csv"])["strategy"].tolist() == ["traditional", "sb", "kath18"]


def test_write_pareto_report_without_traditional(tmp_path):
    curves = {key: curve for key, curve in CURVES.items() if key[0] != "traditional"}
    written = write_pareto_report(trial_frame(curves), tmp_path)
    assert "speedups.csv" not in written and not (tmp_path / "speedups.csv").exists()
    assert "need a 'traditional' trial" in written["speedups.md"].read_text()
    assert_png(written["curves.png"])


def test_cli_pareto(tmp_path, capsys):
    run = write_run(tmp_path / "trad", "traditional", [(5, 0.5), (9, 0.25)])
    sweep = write_sweep(tmp_path / "sweep", {("sb", "s1"): [(2, 0.4), (4, 0.26)]})
    assert main(["pareto", str(run)]) == 0
    assert (run / "speedups.md").is_file() and (run / "pareto.png").is_file()
    out = tmp_path / "out"
    assert main(["pareto", str(run), str(sweep), "--out", str(out), "--targets", "1.1,1.5"]) == 0
    assert "| strategy | final error | 1.1E | 1.5E |" in capsys.readouterr().out
    assert (out / "speedups.csv").is_file()


def test_cli_pareto_errors(tmp_path, capsys):
    (tmp_path / "nothing").mkdir()
    assert main(["pareto", str(tmp_path / "nothing")]) == 2
    assert "raysb: error:" in capsys.readouterr().err
    a = write_run(tmp_path / "a", "sb", [(1, 0.3)])
    b = write_run(tmp_path / "b", "sb", [(1, 0.3)])
    assert main(["pareto", str(a), str(b)]) == 2
    assert "--out" in capsys.readouterr().err


def test_speedups_against_the_uniform_baseline_name_where_sb_does_not_beat_it(tmp_path):
    # uniform reaches 1.4E (0.14) at 5 s, before sb's 6 s; 1.1E and 1.2E at 12 s, after sb's 10 s.
    curves = {**CURVES, ("uniform", "u1"): [(5, 0.13), (12, 0.108)]}
    written = write_pareto_report(trial_frame(curves), tmp_path / "report")
    markdown = written["speedups.md"].read_text()
    assert "| strategy | final error | 1.1E | 1.2E | 1.4E | 1.1E vs uniform | 1.2E vs uniform | 1.4E vs uniform |" in markdown
    assert "| sb | 11.20% | 3.00x | 2.40x | 3.33x | 1.20x | 1.20x | 0.83x |" in markdown
    assert "**sb does not beat uniform at 1.4E.**" in markdown
    assert pd.read_csv(written["speedups.csv"])["strategy"].tolist() == ["traditional", "uniform", "sb", "kath18"]


def test_a_target_only_uniform_never_reaches_counts_as_beating_it(tmp_path):
    """A sweep where uniform never reached 1.1E once printed "sb does not beat uniform at 1.1E"
    beside a table in which sb reached it; "–: never reached" did not say whose target it was."""
    # uniform reaches 1.4E (0.14) at 5 s, before sb's 6 s, and never 1.2E or 1.1E.
    curves = {**CURVES, ("uniform", "u1"): [(5, 0.13), (12, 0.125)]}
    markdown = write_pareto_report(trial_frame(curves), tmp_path / "report")["speedups.md"].read_text()
    assert "| sb | 11.20% | 3.00x | 2.40x | 3.33x | ∞ | ∞ | 0.83x |" in markdown
    assert "**sb does not beat uniform at 1.4E.**" in markdown
    assert "1.1E" not in "".join(line for line in markdown.splitlines() if "does not beat" in line and "sb" in line)
    assert "(–: that row's strategy never reached it)" in markdown
    assert "∞: that row's strategy reached it and uniform never did" in markdown


def test_two_runs_of_one_strategy_get_two_colours_of_its_family():
    from matplotlib.colors import to_rgb

    from raysb.analysis.plots import trial_colours
    from raysb.core.strategy_table import STRATEGIES

    trials = pd.DataFrame({"trial_id": ["sb-a", "sb-a", "sb-b", "traditional-x"],
                           "strategy": ["sb", "sb", "sb", "traditional"]})
    colours = trial_colours(trials)
    assert set(colours) == {"sb-a", "sb-b", "traditional-x"}
    assert colours["sb-a"] != colours["sb-b"]
    # A strategy's only run keeps the strategy's colour; several are shades of it.
    assert colours["traditional-x"] == pytest.approx(to_rgb(STRATEGIES["traditional"].colour))
    base = to_rgb(STRATEGIES["sb"].colour)
    darker = [c <= b + 1e-9 for c, b in zip(colours["sb-a"], base)]
    lighter = [c >= b - 1e-9 for c, b in zip(colours["sb-b"], base)]
    assert all(darker) and all(lighter)
