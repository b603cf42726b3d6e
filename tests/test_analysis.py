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
from raysb.analysis.work import trial_work, with_work
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


def write_run(folder, strategy, curve, summary=True, **config_values):
    folder.mkdir(parents=True)
    pd.DataFrame(metric_rows(curve)).to_parquet(folder / "metrics.parquet")
    config = {"strategy": strategy, "seed": 3, "lr_milestones": [60, 120], "model_options": {}, "lr_schedule": "static",
              **config_values}
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
    # A run folder's report goes into its own folder, not among the run's files; a sweep's into the sweep.
    assert (run / "pareto" / "speedups.md").is_file() and (run / "pareto" / "pareto.png").is_file()
    assert not (run / "speedups.md").exists()
    assert main(["pareto", str(sweep)]) == 0 and (sweep / "speedups.md").is_file()
    out = tmp_path / "out"
    assert main(["pareto", str(run), str(sweep), "--out", str(out), "--targets", "1.1,1.5"]) == 0
    assert "| strategy | final error | 1.1E | 1.5E |" in capsys.readouterr().out
    assert (out / "speedups.csv").is_file()


def test_pareto_warns_when_the_compared_runs_trained_on_different_data(tmp_path, capsys):
    same = [write_run(tmp_path / name, strategy, [(5, 0.5), (9, 0.25)], subset=1000, label_noise=0.0)
            for name, strategy in (("trad", "traditional"), ("sb", "sb"))]
    assert main(["pareto", *map(str, same), "--out", str(tmp_path / "same")]) == 0
    assert "different data" not in capsys.readouterr().out
    other = write_run(tmp_path / "sb-2000", "sb", [(5, 0.4)], subset=2000, label_noise=0.2)
    assert main(["pareto", *map(str, same), str(other), "--out", str(tmp_path / "mixed")]) == 0
    warning = ("**Warning: the compared runs trained or were tested on different data: subset 1000 (`trad`), 2000 "
               "(`sb-2000`); label_noise 0.0 (`trad`), 0.2 (`sb-2000`).")
    assert warning in capsys.readouterr().out
    assert (tmp_path / "mixed" / "speedups.md").read_text().startswith(warning)


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
    assert "**sb does not beat uniform at 1.4E in wall-clock time.**" in markdown
    assert pd.read_csv(written["speedups.csv"])["strategy"].tolist() == ["traditional", "uniform", "sb", "kath18"]


def test_a_target_only_uniform_never_reaches_counts_as_beating_it(tmp_path):
    """A sweep where uniform never reached 1.1E once printed "sb does not beat uniform at 1.1E"
    beside a table in which sb reached it; "–: never reached" did not say whose target it was."""
    # uniform reaches 1.4E (0.14) at 5 s, before sb's 6 s, and never 1.2E or 1.1E.
    curves = {**CURVES, ("uniform", "u1"): [(5, 0.13), (12, 0.125)]}
    markdown = write_pareto_report(trial_frame(curves), tmp_path / "report")["speedups.md"].read_text()
    assert "| sb | 11.20% | 3.00x | 2.40x | 3.33x | ∞ | ∞ | 0.83x |" in markdown
    assert "**sb does not beat uniform at 1.4E in wall-clock time.**" in markdown
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


# -- time to target in work ----------------------------------------------------

TRAIN_EXAMPLES = 20_032


def write_counted_run(folder, strategy, epochs, scoring_cost=None, phase_times=None):
    """A run folder as `raysb train` writes one, with the counts work is read from: `epochs` holds each
    evaluated epoch's cumulative (wall_s, trained examples, scored examples, test error); `phase_times`
    its cumulative {metrics column: seconds} at every epoch, for a run that recorded no scoring cost."""
    folder.mkdir(parents=True)
    rows = [
        {**{column: 0 for column in METRIC_COLUMNS}, **(phase_times or {}), "epoch": epoch, "wall_s": wall_s,
         "backprop_examples": trained, "train_forward_examples": trained, "selection_forward_examples": scored,
         "test_error": error}
        for epoch, (wall_s, trained, scored, error) in enumerate(epochs, start=1)
    ]
    pd.DataFrame(rows).to_parquet(folder / "metrics.parquet")
    config = {"strategy": strategy, "seed": 0, "scoring_cost": None}
    summary = {"status": "completed", "config": config, "train_examples": TRAIN_EXAMPLES,
               "scoring_cost": scoring_cost, "training_wall_s": epochs[-1][0]}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_pareto_gives_time_to_target_in_work_and_warns_when_the_runs_ran_at_different_speeds(tmp_path, capsys):
    """A review found `raysb pareto` saying free-sb reached its targets 7.96x sooner than Traditional:
    both had trained 40,064 examples, Traditional at 95 examples a second and free-sb at 231, the
    machine's load having changed between them."""
    # Both train 2 epochs of 20,032 examples; Traditional reaches 1.1E (11%) in its second, free-sb in its first.
    trad = write_counted_run(tmp_path / "l_trad", "traditional", [(210.88, 20_032, 0, 0.30), (421.73, 40_064, 0, 0.10)])
    free = write_counted_run(tmp_path / "l_free", "free-sb", [(86.71, 20_032, 0, 0.105), (173.43, 40_064, 0, 0.095)])
    out = tmp_path / "report"
    assert main(["pareto", str(trad), str(free), "--out", str(out), "--targets", "1.1"]) == 0
    printed = capsys.readouterr().out
    assert "| free-sb | 9.50% | 4.86x (work 2.00x) |" in printed
    assert ("**Warning: the compared runs' examples a second (trained, plus scored at their scoring cost, per "
            "second of training) differ by more than 20%: 95 (`l_trad`) to "
            "231 (`l_free`), 2.43x, over 2 runs;") in printed
    table = pd.read_csv(out / "speedups.csv").set_index("strategy")
    assert table.loc["free-sb", ["time_to_1.1E_s", "work_to_1.1E_epochs", "work_speedup_1.1E"]].tolist() == [
        86.71, 1.0, 2.0]
    assert table.loc["free-sb", "work_trial_1.1E"] == "l_free"
    assert table.loc["traditional", "work_to_1.1E_epochs"] == 2.0
    assert (out / "curves.png").is_file()


def test_scored_examples_count_at_the_run_s_scoring_cost_recorded_or_estimated(tmp_path):
    # Every run at 95 examples a second of work: no warning. sb scores all 20,032 examples and trains
    # 6,677 in its epoch; at a recorded cost of 0.5 that is (6,677 + 10,016) / 20,032 epochs of work.
    trad = write_counted_run(tmp_path / "trad", "traditional", [(210.88, 20_032, 0, 0.30), (421.73, 40_064, 0, 0.10)])
    sb = write_counted_run(tmp_path / "sb", "sb", [(175.72, 6_677, 20_032, 0.105)], scoring_cost=0.5)
    # No cost recorded: 10 s scoring 20,032 examples and 20 s training 6,677 give (10 / 20,032) / (20 / 6,677).
    estimated = write_counted_run(tmp_path / "sb_estimated", "sb", [(105.0, 6_677, 20_032, 0.108)],
                                  phase_times={"time_selection_s": 10.0, "time_train_forward_s": 5.0,
                                               "time_backward_s": 15.0})
    written = write_pareto_report(load_trials([trad, sb, estimated]), tmp_path / "report", targets=(1.1,))
    table = pd.read_csv(written["speedups.csv"]).set_index("strategy")
    cost = (10 / 20_032) / (20 / 6_677)
    assert table.loc["sb", "work_trial_1.1E"] == "sb_estimated"
    assert table.loc["sb", "work_to_1.1E_epochs"] == pytest.approx((6_677 + cost * 20_032) / 20_032)
    assert table.loc["sb", "trial_1.1E"] == "sb_estimated"
    markdown = written["speedups.md"].read_text()
    assert "Warning" not in markdown
    assert ("summary.json records none (`--work-budget` or `--set scoring_cost=C` records one): "
            f"`sb_estimated` {cost:.2f}") in markdown
    recorded = write_pareto_report(load_trials([trad, sb]), tmp_path / "recorded", targets=(1.1,))
    work = pd.read_csv(recorded["speedups.csv"]).set_index("strategy").loc["sb", "work_to_1.1E_epochs"]
    assert work == pytest.approx((6_677 + 0.5 * 20_032) / 20_032)
    assert "Warning" not in recorded["speedups.md"].read_text()


def test_whether_a_strategy_beats_uniform_is_said_in_both_clocks(tmp_path):
    # 1.1E (11%): uniform at 50 s and a third of an epoch's work, free-sb at 40 s and a whole epoch's.
    runs = [write_counted_run(tmp_path / "trad", "traditional", [(210.88, 20_032, 0, 0.30), (421.73, 40_064, 0, 0.10)]),
            write_counted_run(tmp_path / "uniform", "uniform", [(50.0, 6_677, 0, 0.105)]),
            write_counted_run(tmp_path / "free", "free-sb", [(40.0, 20_032, 0, 0.105)])]
    markdown = write_pareto_report(load_trials(runs), tmp_path / "report", targets=(1.1,))["speedups.md"].read_text()
    assert "| free-sb | 10.50% | 10.54x (work 2.00x) | 1.25x (work 0.33x) |" in markdown
    assert "Every selective strategy beats uniform at every target in wall-clock time." in markdown
    assert "**free-sb does not beat uniform at 1.1E in work.**" in markdown


def test_a_sweep_s_work_is_read_from_its_trials_summaries(tmp_path):
    """trials.parquet has each trial's metrics and config; its train_examples and recorded scoring cost
    are in the trial's own folder, trials/<trial_id>/summary.json."""
    sweep = tmp_path / "sweep"
    trials = {"traditional": write_counted_run(sweep / "trials" / "t_trad", "traditional",
                                               [(100.0, 20_032, 0, 0.2), (200.0, 40_064, 0, 0.1)]),
              "sb": write_counted_run(sweep / "trials" / "t_sb", "sb", [(80.0, 6_677, 20_032, 0.1)], scoring_cost=0.25)}
    rows = [pd.read_parquet(trial / "metrics.parquet").assign(trial_id=trial.name, trial_status="completed",
                                                               strategy=strategy)
            for strategy, trial in trials.items()]
    pd.concat(rows, ignore_index=True).to_parquet(sweep / "trials.parquet")
    written = write_pareto_report(load_trials([sweep]), tmp_path / "report", targets=(1.0,))
    table = pd.read_csv(written["speedups.csv"]).set_index("strategy")
    assert table.loc["sb", "work_to_1E_epochs"] == pytest.approx((6_677 + 0.25 * 20_032) / 20_032)
    assert table.loc["sb", "work_speedup_1E"] == pytest.approx(2.0 / ((6_677 + 0.25 * 20_032) / 20_032))


def test_without_summaries_work_is_left_out_and_said_so(tmp_path):
    markdown = write_pareto_report(trial_frame(CURVES), tmp_path / "report")["speedups.md"].read_text()
    assert "| sb | 11.20% | 3.00x | 2.40x | 3.33x |" in markdown and "(work" not in markdown
    assert "Work not counted, so left out of the work columns: `k1`, `k2`, `s1`, `s2`, `t1`, `t2`" in markdown


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """A Traditional run and an SB run under a work budget (its scoring cost measured and recorded), small."""
    folder = tmp_path_factory.mktemp("real_runs")
    small = ["--subset", "1000", "--test-subset", "200", "--epochs", "2", "--set", "model_options.width=8"]
    assert main(["train", *small, "--strategy", "traditional", "--out", str(folder / "trad")]) == 0
    assert main(["train", *small, "--strategy", "sb", "--work-budget", "2", "--out", str(folder / "sb")]) == 0
    return folder


@pytest.mark.slow  # two real runs: about 15-20 s on a loaded 2-core machine
def test_pareto_and_report_of_real_runs_count_the_work_their_trainer_counted(real_runs, capsys):
    trad, sb = real_runs / "trad", real_runs / "sb"
    assert main(["pareto", str(trad), str(sb), "--out", str(real_runs / "pareto"), "--targets", "1.0"]) == 0
    assert "(work " in capsys.readouterr().out
    table = pd.read_csv(real_runs / "pareto" / "speedups.csv").set_index("strategy")
    # Traditional scores nothing: its work at E is the examples it had trained then, over the 1,000.
    metrics = pd.read_parquet(trad / "metrics.parquet")
    at_target = metrics.loc[metrics["test_error"] <= metrics["test_error"].iloc[-1]].iloc[0]
    assert table.loc["traditional", "work_to_1E_epochs"] == at_target["backprop_examples"] / 1000
    # SB's work at its last epoch is what its trainer counted against its budget, at its measured cost.
    summary = json.loads((sb / "summary.json").read_text())
    trials = load_trials([sb])
    assert summary["scoring_cost"] > 0
    assert with_work(trials, trial_work(trials))["work_epochs"].iloc[-1] == pytest.approx(summary["work_epochs"])

    assert main(["report", str(trad), str(sb), "--out", str(real_runs / "report")]) == 0
    report = (real_runs / "report" / "report.md").read_text()
    assert f"| {summary['work_epochs']:.3g} |" in report
    assert "## Time to target (Table 1)" in report
    assert set(pd.read_csv(real_runs / "report" / "time_to_target.csv")["strategy"]) == {"traditional", "sb"}
