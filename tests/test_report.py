"""`raysb report`: the paper's figures from run folders, their math, files and skip reasons."""

import json
import re

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raysb.analysis import AnalysisError
from raysb.analysis.paper_figures import (
    accuracy_by_percentile,
    confidence_percentiles,
    empirical_cdf,
    flipped_shares,
    probability_fluctuation,
    seconds_per_epoch,
    selection_extremes,
    similarity_by_epoch,
    snapshot_epochs,
    target_confidence,
)
from raysb.analysis.run_report import CDF_RUN, write_run_report
from raysb.cli import main
from raysb.config import TrainConfig
from raysb.core.strategy_table import STRATEGIES
from raysb.data.prepare import prepare_data
from raysb.models import build_model
from raysb.training.outputs import METRIC_COLUMNS

from conftest import needs_fashion_mnist

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CPU = torch.device("cpu")
SUBSET, TEST_SUBSET, EPOCHS = 200, 100, 4
# Seconds per phase over the whole run; per epoch they are a quarter of these.
BREAKDOWN = {"selection": 4.0, "train_forward": 2.0, "backward": 8.0, "data": 1.0, "bookkeeping": 0.4, "other": 0.6}


# -- the math ------------------------------------------------------------------


def test_accuracy_by_percentile_bins_by_rank_of_target_confidence():
    # Ranked by confidence: 0.1 (wrong), 0.2 (right), 0.3 (wrong), 0.6 (right), 0.8 (right), 0.9 (right).
    confidence = [0.9, 0.1, 0.6, 0.3, 0.8, 0.2]
    correct = [True, False, True, False, True, True]
    table = accuracy_by_percentile(confidence, correct, bins=3)
    assert table["percentile"].tolist() == pytest.approx([0, 100 / 3, 200 / 3])
    assert table["examples"].tolist() == [2, 2, 2]
    assert table["accuracy"].tolist() == [0.5, 0.5, 1.0]
    # More bins than examples: every example in a bin of its own, the rest empty.
    sparse = accuracy_by_percentile([0.5, 0.1], [True, False], bins=4)
    assert sparse["examples"].tolist() == [1, 0, 1, 0]
    assert sparse["accuracy"].iloc[0] == 0.0 and sparse["accuracy"].iloc[2] == 1.0
    assert sparse["accuracy"].iloc[[1, 3]].isna().all()


def test_accuracy_by_percentile_keeps_input_order_for_equal_confidence():
    table = accuracy_by_percentile([0.5, 0.5, 0.5, 0.5], [False, False, True, True], bins=2)
    assert table["accuracy"].tolist() == [0.0, 1.0]


def test_target_confidence_and_its_percentiles():
    probabilities = [[0.7, 0.2, 0.1], [0.3, 0.3, 0.4], [0.1, 0.6, 0.3]]
    confidence, correct = target_confidence(probabilities, [0, 0, 2])
    assert confidence.tolist() == [0.7, 0.3, 0.3]
    assert correct.tolist() == [True, False, False]
    table = confidence_percentiles(np.linspace(0, 1, 201))
    assert table["percentile"].tolist() == list(range(101))
    assert table["confidence"].to_numpy() == pytest.approx(np.arange(101) / 100)


def test_selection_extremes_order_and_ties():
    counts = pd.DataFrame(
        {
            "sample_id": [10, 11, 12, 13, 14, 15, 16, 17],
            "considered": [4, 2, 4, 0, 5, 3, 4, 4],
            "kept": [4, 2, 1, 0, 0, 0, 2, 3],
        }
    )
    table = selection_extremes(counts, count=3)
    assert table["group"].tolist() == ["most kept"] * 3 + ["least kept"] * 3
    assert table["rank"].tolist() == [1, 2, 3] * 2
    # 4/4 before 2/2 (same ratio, kept more often), then 3/4.
    assert table["sample_id"].tolist()[:3] == [10, 11, 17]
    # 0/5 before 0/3 (offered more often); 13 was never offered and does not count.
    assert table["sample_id"].tolist()[3:] == [14, 15, 12]
    assert table["kept_ratio"].tolist() == pytest.approx([1, 1, 0.75, 0, 0, 0.25])
    # Seven offered examples: at most three per group, so none is in both.
    assert len(selection_extremes(counts, count=8)) == 6


def test_flipped_shares():
    counts = pd.DataFrame({"sample_id": [1, 2, 3, 4, 5], "considered": [3] * 5, "kept": [3, 1, 0, 2, 2]})
    kept_share, data_share = flipped_shares(counts, [1, 4])
    assert kept_share == pytest.approx(5 / 8)
    assert data_share == pytest.approx(2 / 5)
    assert np.isnan(flipped_shares(counts.assign(kept=0), [1])[0])


def test_seconds_per_epoch_covers_every_phase():
    assert seconds_per_epoch({"selection": 6.0, "backward": 3.0, "other": 1.5}, 3) == {
        "selection": 2.0, "train_forward": 0.0, "backward": 1.0, "train_step": 0.0, "data": 0.0, "bookkeeping": 0.0,
        "other": 0.5,
    }
    with pytest.raises(ValueError):
        seconds_per_epoch({}, 0)


def test_loss_cdf_at_first_middle_and_last_epoch():
    assert snapshot_epochs([3, 1, 2, 5, 4, 5]) == [1, 3, 5]
    assert snapshot_epochs([2, 1, 2]) == [1, 2]
    losses = pd.DataFrame({"epoch": [1, 1, 1, 1, 2, 2], "loss": [0.4, 0.1, 0.4, 0.2, 9.0, 7.0]})
    table = empirical_cdf(losses, [1, 2])
    assert table["epoch"].tolist() == [1, 1, 1, 1, 2, 2]
    assert table["loss"].tolist() == pytest.approx([0.1, 0.2, 0.4, 0.4, 7.0, 9.0])
    assert table["cdf"].tolist() == [0.25, 0.5, 0.75, 1.0, 0.5, 1.0]


def test_similarity_by_epoch_mean_min_max_over_probe_batches():
    rows = pd.DataFrame(
        {
            "epoch": [1, 1, 2, 2],
            "probe_batch": [0, 1, 0, 1],
            "cosine_kept": [0.5, 0.7, 0.8, np.nan],
            "cosine_random": [0.2, 0.4, 0.3, 0.5],
            "same_sign_kept": [0.6, 0.8, 0.9, 0.7],
            "same_sign_random": [0.5, 0.5, 0.5, 0.7],
        }
    )
    table = similarity_by_epoch(rows).set_index(["epoch", "measure", "subset"])
    assert table.loc[(1, "cosine", "kept"), ["mean", "min", "max"]].tolist() == pytest.approx([0.6, 0.5, 0.7])
    assert table.loc[(2, "cosine", "kept"), ["mean", "probe_batches"]].tolist() == pytest.approx([0.8, 1])
    assert table.loc[(2, "same_sign", "random"), ["mean", "min", "max"]].tolist() == pytest.approx([0.6, 0.5, 0.7])
    assert len(table) == 8


def test_probability_fluctuation():
    tracked = pd.DataFrame({"sample_id": [1, 1, 2, 2], "probability": [0.2, 0.6, 0.5, 0.5]})
    assert probability_fluctuation(tracked) == pytest.approx(0.1)  # std 0.2 and 0, mean 0.1


# -- run folders in the trainer's formats --------------------------------------


def write_table(path, columns):
    pq.write_table(pa.table(columns), path)


def make_run(folder, strategy, selectivity=1 / 3, label_noise=0.0, traces=True, sample_ids=None, flipped=(),
             subset=SUBSET):
    """A finished run folder: config.yaml, summary.json, metrics.parquet and (optionally) every trace file.

    `sample_ids` are its training examples (the real subset where the data is needed).
    Selection counts: every example offered EPOCHS times; flipped examples always kept,
    the others kept once every third id.
    """
    folder.mkdir(parents=True)
    config = TrainConfig.from_dict(
        dict(dataset="fashion-mnist", subset=subset, test_subset=TEST_SUBSET, model="small-cnn",
             model_options={"width": 4}, strategy=strategy, selectivity=selectivity, label_noise=label_noise,
             batch_size=16, epochs=EPOCHS, out=str(folder))
    )
    config.save(folder / "config.yaml")
    errors = [0.5 - 0.05 * epoch - selectivity / 10 + label_noise for epoch in range(EPOCHS)]
    rows = [
        {**{column: 0 for column in METRIC_COLUMNS}, "epoch": epoch, "wall_s": 10.0 * epoch * selectivity,
         "test_error": error, **{f"time_{phase}_s": seconds * epoch / EPOCHS for phase, seconds in BREAKDOWN.items()}}
        for epoch, error in enumerate(errors, start=1)
    ]
    pd.DataFrame(rows).to_parquet(folder / "metrics.parquet")
    summary = {
        "status": "completed", "config": config.to_dict(), "time_breakdown_s": BREAKDOWN,
        "training_wall_s": rows[-1]["wall_s"], "epochs_completed": EPOCHS, "final_test_error": errors[-1],
        "label_noise_flipped_ids": [int(i) for i in flipped], "train_examples": SUBSET,
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    if not traces:
        return folder
    ids = np.asarray(sample_ids if sample_ids is not None else np.arange(1000, 1000 + SUBSET), dtype=np.int64)
    kept = np.where(np.isin(ids, list(flipped)) | (ids % 3 == 0), EPOCHS, 0)
    write_table(folder / "selection_counts.parquet", {
        "sample_id": ids, "considered": np.full(ids.size, EPOCHS, np.int32), "kept": kept.astype(np.int32)})
    torch.manual_seed(0)
    torch.save(build_model("small-cnn", 10, 1, 28, width=4).state_dict(), folder / "model.pt")
    if STRATEGIES[strategy].cdf_report:  # what raysb.training.trace records for the strategies whose cards say so
        epochs = np.repeat(np.arange(1, EPOCHS + 1, dtype=np.int32), 64)
        write_table(folder / "loss_cdf.parquet", {
            "epoch": epochs, "loss": (np.tile(np.linspace(0.1, 2.0, 64), EPOCHS) / epochs).astype(np.float32)})
        tracked_ids = np.tile(ids[:4], EPOCHS)
        tracked_epochs = np.repeat(np.arange(1, EPOCHS + 1, dtype=np.int32), 4)
        probability = np.linspace(0.05, 0.95, tracked_ids.size).astype(np.float32)
        write_table(folder / "tracked_examples.parquet", {
            "epoch": tracked_epochs, "optimizer_step": (tracked_epochs * 10).astype(np.int64), "sample_id": tracked_ids,
            "loss": probability * 2, "percentile": probability ** 0.5, "probability": probability,
            "kept": probability > 0.5})
        probe_epochs = np.repeat(np.arange(1, EPOCHS + 1, dtype=np.int32), 3)
        write_table(folder / "gradient_similarity.parquet", {
            "epoch": probe_epochs, "probe_batch": np.tile(np.arange(3, dtype=np.int32), EPOCHS),
            "batch_size": np.full(probe_epochs.size, 16, np.int32),
            "kept_count": np.full(probe_epochs.size, 5, np.int32),
            "cosine_kept": np.tile([0.7, 0.8, 0.9], EPOCHS), "cosine_random": np.tile([0.4, 0.5, 0.6], EPOCHS),
            "same_sign_kept": np.full(probe_epochs.size, 0.85), "same_sign_random": np.full(probe_epochs.size, 0.65)})
    return folder


def real_subset(label_noise):
    """The training sample ids and flipped ids a run with this label noise trains on."""
    config = TrainConfig.from_dict(dict(dataset="fashion-mnist", subset=SUBSET, test_subset=TEST_SUBSET,
                                        batch_size=16, label_noise=label_noise))
    train, test, flipped = prepare_data(config.settings().data, config.batch_size)
    return train, test, flipped


def assert_png(path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 1000


# -- the whole report ----------------------------------------------------------


@pytest.mark.slow
@needs_fashion_mnist
def test_report_of_a_label_noise_and_a_selectivity_sweep_writes_every_figure(tmp_path):
    clean_train, test, _ = real_subset(0.0)
    noisy_train, _, flipped = real_subset(0.1)
    runs = [
        make_run(tmp_path / "trad", "traditional", sample_ids=clean_train.sample_ids.numpy()),
        make_run(tmp_path / "sb_half", "sb", selectivity=0.5, sample_ids=clean_train.sample_ids.numpy()),
        make_run(tmp_path / "sb_noisy", "sb", selectivity=0.5, label_noise=0.1,
                 sample_ids=noisy_train.sample_ids.numpy(), flipped=flipped.tolist()),
        make_run(tmp_path / "sb_third", "sb", traces=False),
    ]
    result = write_run_report(runs, tmp_path / "report", device=CPU)
    out = tmp_path / "report"
    stems = ["loss_cdf", "selection_probability", "gradient_similarity", "confidence_percentiles",
             "accuracy_percentiles", "time_to_target", "time_breakdown", "label_noise", "selectivity_sb",
             "selected_examples_sb_half", "selected_examples_sb_noisy"]
    assert set(result.written) == {f"{stem}.{ext}" for stem in stems for ext in ("png", "csv")} | {"report.md"}
    for stem in stems:
        assert_png(out / f"{stem}.png")
        assert (out / f"{stem}.csv").is_file()
    # No run here keeps margins: the doubted labels' section says so (it draws in the test below).
    assert list(result.skipped) == ["Labels the run doubts"]
    assert "sb keeps no margins" in result.skipped["Labels the run doubts"]

    # Seconds per epoch per phase: the run's totals over its 4 epochs.
    times = pd.read_csv(out / "time_breakdown.csv").set_index("run")
    assert times.loc["sb_half", ["selection_s", "backward_s", "other_s"]].tolist() == pytest.approx([1.0, 2.0, 0.15])
    assert times.loc["trad", "total_s"] == pytest.approx(4.0)

    # Flipped examples are always kept, the others when their id is a multiple of 3.
    noise = pd.read_csv(out / "label_noise.csv").set_index("run")
    ids = noisy_train.sample_ids.numpy()
    is_flipped = np.isin(ids, flipped.numpy())
    kept = is_flipped | (ids % 3 == 0)
    assert noise.loc["sb_noisy", "flipped_share_of_kept"] == pytest.approx(is_flipped.sum() / kept.sum())
    assert noise.loc["sb_noisy", "flipped_share_of_data"] == pytest.approx(20 / SUBSET)
    assert noise.loc[["trad", "sb_half"], "flipped_share_of_kept"].isna().all()
    assert noise.loc["sb_noisy", "final_test_error"] == pytest.approx(0.5 - 0.15 - 0.05 + 0.1)
    # A strategy's line varies the noise only: sb_third is at another selectivity.
    assert "sb_third" not in noise.index
    # And the selectivity figure compares sb at the cleanest labels only.
    assert set(pd.read_csv(out / "selectivity_sb.csv")["run"]) == {"sb_half", "sb_third"}

    # Most kept: kept every time, lowest ids first among equals; images and labels from the real subset.
    selected = pd.read_csv(out / "selected_examples_sb_noisy.csv")
    most = selected.loc[selected["group"] == "most kept"]
    assert most["sample_id"].tolist() == sorted(ids[kept])[:8]
    labels = dict(zip(ids.tolist(), noisy_train.labels.tolist()))
    assert most["label"].tolist() == [labels[i] for i in most["sample_id"]]
    assert most["flipped"].tolist() == np.isin(most["sample_id"], flipped.numpy()).tolist()
    assert (selected.loc[selected["group"] == "least kept", "kept"] == 0).all()

    # The final model, rebuilt from model.pt and evaluated with the training normalisation.
    torch.manual_seed(0)
    model = build_model("small-cnn", 10, 1, 28, width=4).eval()
    with torch.no_grad():
        inputs = (test.images.float() / 255 - clean_train.mean[0]) / clean_train.std[0]
        probabilities = torch.softmax(model(inputs), 1)
    expected = probabilities[torch.arange(TEST_SUBSET), test.labels].numpy()
    confidence = pd.read_csv(out / "confidence_percentiles.csv")
    trad_confidence = confidence.loc[confidence["run"] == "trad", "confidence"].to_numpy()
    assert trad_confidence == pytest.approx(np.percentile(expected, np.arange(101)), rel=1e-5)
    accuracy = pd.read_csv(out / "accuracy_percentiles.csv")
    trad_accuracy = accuracy.loc[accuracy["run"] == "trad"]
    assert (trad_accuracy["examples"] == 1).all()  # 100 test examples, 100 bins
    right = (probabilities.argmax(1) == test.labels).numpy()
    ranked = right[np.argsort(expected, kind="stable")]
    assert trad_accuracy["accuracy"].to_numpy() == pytest.approx(ranked.astype(float))

    markdown = (out / "report.md").read_text()
    for heading in ("Loss CDF (Figure 3)", "Accuracy percentiles (Figure 9)", "Selectivity sensitivity (Figure 13)"):
        assert f"## {heading}" in markdown
    assert "![loss_cdf](loss_cdf.png)" in markdown and "[time_breakdown.csv](time_breakdown.csv)" in markdown
    assert "`trad`: traditional keeps every example" in markdown
    assert "`sb_third`: no selection_counts.parquet" in markdown
    assert "`sb_third`: selectivity 0.333, the other sb runs 0.5" in markdown
    assert "`sb_noisy`: label noise 0.1, the others 0" in markdown
    assert "selectivity 0.333: 31.67% in 13.3 s; selectivity 0.5: 30.00% in 20 s" in markdown
    assert "`sb_half` kept 0.800 vs random 0.500" in markdown


def test_report_of_one_traditional_run_skips_what_it_cannot_support(tmp_path):
    run = make_run(tmp_path / "trad", "traditional", traces=False)
    result = write_run_report([run], tmp_path / "out", device=CPU)
    assert set(result.written) == {"time_breakdown.png", "time_breakdown.csv", "report.md"}
    assert result.skipped["Label-noise sensitivity (Figure 12)"] == (
        "needs runs with at least two label_noise values (found 0)"
    )
    assert result.skipped["Selectivity sensitivity (Figure 13)"] == (
        "needs runs of one strategy at two or more selectivity values (found none)"
    )
    # CDF_RUN names the strategies whose cards say their runs record the CDF, however many the table has.
    assert result.skipped["Loss CDF (Figure 3)"] == f"needs {CDF_RUN} (found only traditional)"
    # Recorded only when asked for: the reason names the flag that records it.
    assert result.skipped["Confidence percentiles (Figure 8)"].endswith(
        "; left out `trad`: no model.pt (recorded with --record-analysis, or record_analysis: true in a config or "
        "sweep)")
    assert "traditional keeps every example" in result.skipped["Most and least selected examples (Figure 2)"]
    assert result.skipped["Time to target (Table 1)"] == "needs a run of another strategy than traditional to compare"
    assert "traditional keeps no margins" in result.skipped["Labels the run doubts"]
    # It names the strategies whose cards say their runs keep margins, each once, and the option that turns
    # them on where one does, however many the table has.
    need = re.fullmatch(r"needs a run that keeps margins \((.*)\) with label_suspects\.parquet; left out .*",
                        result.skipped["Labels the run doubts"])
    named = re.split(r", | or ", need[1])
    assert sorted(named) == sorted(name if card.keeps_margins is True else f"{name} with {card.keeps_margins} on"
                                   for name, card in STRATEGIES.items() if card.keeps_margins)
    assert {"free-sb", "infobatch", "stale-sb with label_doubt on"} <= set(named)
    assert len(result.skipped) == 10
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "Skipped: needs runs with at least two label_noise values (found 0)." in markdown


@pytest.mark.slow
@needs_fashion_mnist
def test_free_sb_and_infobatch_runs_get_every_figure_that_applies_to_them(tmp_path):
    """`raysb report` once skipped 5 figures for free-sb and InfoBatch runs ("needs an sb or stale-sb
    run"), and its selectivity figure took only sb runs."""
    train, _, _ = real_subset(0.0)
    runs = [make_run(tmp_path / "free_half", "free-sb", selectivity=0.5),
            make_run(tmp_path / "free_third", "free-sb"),
            make_run(tmp_path / "infobatch", "infobatch", sample_ids=train.sample_ids.numpy())]
    result = write_run_report(runs, tmp_path / "out", device=CPU)
    for stem in ("loss_cdf", "gradient_similarity", "selection_probability", "selectivity_free-sb",
                 "selected_examples_infobatch"):
        assert f"{stem}.png" in result.written, stem
    assert set(pd.read_csv(tmp_path / "out" / "selectivity_free-sb.csv")["run"]) == {"free_half", "free_third"}
    assert set(pd.read_csv(tmp_path / "out" / "loss_cdf.csv")["run"]) == {"free_half", "free_third"}
    assert "free-sb: lowest final error at selectivity 0.5" in (tmp_path / "out" / "report.md").read_text()
    # InfoBatch ranks against the mean score, not CDF_R: the CDF figures are for the others only.
    alone = write_run_report([runs[2]], tmp_path / "alone", device=CPU)
    assert alone.skipped["Loss CDF (Figure 3)"] == f"needs {CDF_RUN} (found only infobatch)"
    assert "selected_examples_infobatch.png" in alone.written


def test_report_leaves_out_a_run_without_traces_and_says_why(tmp_path):
    with_traces = make_run(tmp_path / "new", "sb")
    older = make_run(tmp_path / "old", "stale-sb", traces=False)
    result = write_run_report([with_traces, older], tmp_path / "out", device=CPU)
    assert "loss_cdf.png" in result.written
    assert pd.read_csv(tmp_path / "out" / "loss_cdf.csv")["run"].unique().tolist() == ["new"]
    assert ("Left out: `old`: no loss_cdf.parquet (recorded with --record-analysis, or record_analysis: true in a "
            "config or sweep)." in (tmp_path / "out" / "report.md").read_text())


def test_report_errors_for_folders_that_are_not_runs(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(AnalysisError, match="empty is neither a sweep folder .* nor a train run folder"):
        write_run_report([tmp_path / "empty"], tmp_path / "out")
    unevaluated = make_run(tmp_path / "fresh", "sb", traces=False)
    pd.DataFrame({"epoch": [], "wall_s": [], "test_error": []}).to_parquet(unevaluated / "metrics.parquet")
    with pytest.raises(AnalysisError, match="fresh is a train run that stopped before its first evaluated epoch"):
        write_run_report([unevaluated], tmp_path / "out")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    trials = {"trial_id": ["t1"], "strategy": ["sb"], "epoch": [1], "wall_s": [1.0], "test_error": [0.2]}
    pd.DataFrame(trials).to_parquet(sweep / "trials.parquet")
    with pytest.raises(AnalysisError, match="is a sweep folder"):
        write_run_report([sweep], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_report_says_what_a_run_that_failed_in_its_first_epoch_is(tmp_path, capsys):
    """Such a run has a config.yaml and a summary.json but no metrics.parquet: it was once "neither a
    sweep folder nor a train run folder"."""
    failed = tmp_path / "failed"
    small = ["--subset", "1000", "--test-subset", "200", "--epochs", "2", "--set", "model_options.width=8"]
    assert main(["train", *small, "--set", "lr=1e12", "--out", str(failed)]) == 1
    capsys.readouterr()
    assert main(["report", str(failed)]) == 2
    error = capsys.readouterr().err
    assert (f"{failed} is a train run that stopped before its first evaluated epoch: its summary.json says "
            "status failed, error: selection losses are not finite at epoch 1") in error
    interrupted = tmp_path / "interrupted"
    interrupted.mkdir()
    (interrupted / "config.yaml").write_text((failed / "config.yaml").read_text())
    assert main(["report", str(interrupted)]) == 2
    assert (f"{interrupted} is a train run with no evaluated epoch and no summary.json: it was stopped before its "
            "first evaluation, or is still before it") in capsys.readouterr().err


@pytest.mark.slow
@needs_fashion_mnist
def test_kath18_s_kept_share_above_100_percent_says_it_samples_with_replacement(tmp_path):
    train, _, _ = real_subset(0.0)
    ids = train.sample_ids.numpy()
    kath18 = make_run(tmp_path / "kath18", "kath18", sample_ids=ids)
    # Drawn with replacement, a third of the examples were trained twice per offer.
    write_table(kath18 / "selection_counts.parquet", {
        "sample_id": ids, "considered": np.full(ids.size, EPOCHS, np.int32),
        "kept": np.where(ids % 3 == 0, 2 * EPOCHS, 0).astype(np.int32)})
    sb = make_run(tmp_path / "sb", "sb", sample_ids=ids)
    write_run_report([kath18, sb], tmp_path / "out", device=CPU)
    lines = (tmp_path / "out" / "report.md").read_text().splitlines()
    kath18_line = next(line for line in lines if line.startswith("- `kath18`: mean kept/offered"))
    assert kath18_line.endswith("of the 8 most kept 200%, of the least kept 0% (kath18 samples with replacement, "
                                "so an example can be trained more than once per offer)")
    sb_line = next(line for line in lines if line.startswith("- `sb`: mean kept/offered"))
    assert "replacement" not in sb_line


def test_report_warns_in_one_line_when_its_runs_ran_at_different_speeds(tmp_path, capsys):
    trad = make_run(tmp_path / "trad", "traditional", traces=False)
    sb = make_run(tmp_path / "sb", "sb", traces=False)
    # make_run's runs train nothing (zero counts): give them 1,000 trained examples an epoch, in 10 s and 40 s.
    for run, seconds in ((trad, 10.0), (sb, 40.0)):
        metrics = pd.read_parquet(run / "metrics.parquet")
        metrics["backprop_examples"] = 1000 * metrics["epoch"]
        metrics["wall_s"] = seconds * metrics["epoch"]
        metrics.to_parquet(run / "metrics.parquet")
    assert main(["report", str(trad), str(sb), "--out", str(tmp_path / "out")]) == 0
    warning = ("**Warning: the compared runs' examples a second (trained, plus scored at their scoring cost, per "
               "second of training) differ by more than 20%: 25 (`sb`) to 100 (`trad`), 4.00x, over 2 runs; wall-clock "
               "speedups then measure how fast each run went (the machine's load, a strategy's overheads) as much as "
               "what it did, work speedups do not.**")
    assert warning in capsys.readouterr().out.splitlines()
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert warning in markdown
    assert "| `trad` | traditional | 0.333 | 0.0% | 4 | 31.67% | 40 s | 20 | 100 |" in markdown
    assert "- sb reaches 1.1E 0.25x (work 1.00x); 1.2E 0.25x (work 1.00x); 1.4E 0.25x (work 1.00x)" in markdown
    table = pd.read_csv(tmp_path / "out" / "time_to_target.csv").set_index("strategy")
    assert table.loc["traditional", ["time_to_1.1E_s", "work_to_1.1E_epochs"]].tolist() == [40.0, 20.0]


def test_report_warns_when_its_runs_trained_on_different_subsets(tmp_path, capsys):
    trad = make_run(tmp_path / "trad", "traditional", traces=False)
    sb = make_run(tmp_path / "sb", "sb", traces=False)
    assert main(["report", str(trad), str(sb), "--out", str(tmp_path / "same")]) == 0
    assert "different data" not in capsys.readouterr().out
    larger = make_run(tmp_path / "sb-400", "sb", traces=False, subset=2 * SUBSET)
    assert main(["report", str(trad), str(larger), "--out", str(tmp_path / "mixed")]) == 0
    warning = (f"**Warning: the compared runs trained or were tested on different data: subset {SUBSET} (`trad`), "
               f"{2 * SUBSET} (`sb-400`). Their errors and speedups compare the data as much as the strategies.**")
    assert warning in capsys.readouterr().out.splitlines()
    assert warning in (tmp_path / "mixed" / "report.md").read_text()


def test_cli_report(tmp_path, capsys):
    run = make_run(tmp_path / "trad", "traditional", traces=False)
    assert main(["report", str(run)]) == 0
    printed = capsys.readouterr().out
    assert "skipped Label-noise sensitivity (Figure 12): needs runs with at least two label_noise values" in printed
    assert f"wrote report.md and 1 figure(s) with their CSV data to {run / 'report'}" in printed
    assert (run / "report" / "report.md").is_file() and (run / "report" / "time_breakdown.png").is_file()

    other = make_run(tmp_path / "sb", "sb", traces=False)
    assert main(["report", str(run), str(other)]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["report", str(run), str(other), "--out", str(tmp_path / "both")]) == 0
    assert (tmp_path / "both" / "report.md").is_file()

    (tmp_path / "nothing").mkdir()
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "raysb: error:" in capsys.readouterr().err and not (tmp_path / "nothing" / "report").exists()


@needs_fashion_mnist
def test_report_draws_the_labels_a_run_doubts_with_their_images_and_the_margins_histogram(tmp_path):
    noisy_train, _, flipped = real_subset(0.1)
    ids = noisy_train.sample_ids.numpy()
    folder = make_run(tmp_path / "free", "free-sb", label_noise=0.1, sample_ids=ids, flipped=flipped.tolist())
    # What a free-sb run writes (raysb.training.label_suspects): 12 doubted, the 10 most doubted flipped.
    doubted = np.concatenate([flipped.numpy()[:10], ids[~np.isin(ids, flipped.numpy())][:2]])
    write_table(folder / "label_suspects.parquet", {
        "rank": np.arange(1, 13), "sample_id": doubted, "given_label": np.zeros(12, np.int64),
        "model_label": np.ones(12, np.int64), "margin": np.linspace(-5, -0.1, 12).astype(np.float32),
        "trainings": np.full(12, 3, np.int32), "last_loss": np.full(12, 2.0, np.float32)})
    summary = json.loads((folder / "summary.json").read_text())
    summary |= {"suspected_label_share": 0.11, "suspected_labels": 12, "label_margin_histogram": {
        "edges": [-2.0, -1.0, 0.0, 1.0], "counts": [10, 2, 88], "flipped_counts": [10, 0, 10]}}
    (folder / "summary.json").write_text(json.dumps(summary))

    result = write_run_report([folder], tmp_path / "report", device=CPU)
    for stem in ("label_margins_free", "label_suspects_free"):
        assert_png(tmp_path / "report" / f"{stem}.png")
    drawn = pd.read_csv(tmp_path / "report" / "label_suspects_free.csv")
    assert drawn["sample_id"].tolist() == doubted[:8].tolist()  # the most doubted, in rank order
    section = (tmp_path / "report" / "report.md").read_text().split("## Labels the run doubts")[1]
    # 10 of the 20 flipped labels doubted, 10 of the 12 doubted flipped.
    assert "12 doubted, wrong labels estimated at 11.00%" in section
    assert "precision 83.33%, recall 50.00%" in section
    assert "Labels the run doubts" not in result.skipped
