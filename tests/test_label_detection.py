"""raysb.bench.label_detection: its scores, its fold split, and the module end to end on a tiny run."""

import csv
import json
import math

import pytest
import torch
from conftest import needs_fashion_mnist

from raysb.bench import label_detection
from raysb.bench.label_detection import cleanlab_work_epochs, detection_scores, stratified_folds


def test_detection_scores_by_hand():
    # 3 of 5 flagged are flipped; 3 of 4 flipped are flagged.
    scores = detection_scores({1, 2, 3, 10, 11}, torch.tensor([1, 2, 3, 4]))
    assert scores["precision"] == pytest.approx(3 / 5)
    assert scores["recall"] == pytest.approx(3 / 4)
    assert scores["f1"] == pytest.approx(2 * 0.6 * 0.75 / (0.6 + 0.75))
    assert scores["flagged"] == 5


def test_detection_scores_undefined_where_a_set_is_empty():
    nothing_flagged = detection_scores([], [1, 2])
    assert math.isnan(nothing_flagged["precision"]) and nothing_flagged["recall"] == 0 and nothing_flagged["f1"] == 0
    assert math.isnan(detection_scores([1], [])["recall"])
    assert math.isnan(detection_scores([], [])["f1"])


def test_stratified_folds_cover_every_example_once_with_each_class_share():
    labels = torch.tensor([0] * 23 + [1] * 7 + [2] * 50 + [3] * 1)[torch.randperm(81)]
    folds = 5
    assignment = stratified_folds(labels, folds, seed=3)
    assert assignment.shape == labels.shape and set(assignment.tolist()) <= set(range(folds))
    # Every example in exactly one fold: the folds partition the examples.
    members = [torch.nonzero(assignment == fold).squeeze(1) for fold in range(folds)]
    assert sorted(torch.cat(members).tolist()) == list(range(len(labels)))
    for label in range(4):
        per_fold = [int((labels[index] == label).sum()) for index in members]
        share = int((labels == label).sum()) / folds
        assert all(math.floor(share) <= count <= math.ceil(share) for count in per_fold), (label, per_fold)
    sizes = [len(index) for index in members]
    assert max(sizes) - min(sizes) <= 1
    assert torch.equal(assignment, stratified_folds(labels, folds, seed=3))
    assert not torch.equal(assignment, stratified_folds(labels, folds, seed=4))


def test_cleanlab_work_counts_the_forward_at_a_third():
    # 2 folds of 1 epoch on 100 examples: each model trains 50, one forward over all 100.
    assert cleanlab_work_epochs(100, 100) == pytest.approx(1 + 1 / 3)


def test_a_folder_without_its_files_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="summary.json"):
        label_detection.main(["--runs", str(tmp_path), "--out", str(tmp_path / "out")])
    (tmp_path / "summary.json").write_text(json.dumps({}))
    with pytest.raises(SystemExit, match="label_suspects.parquet"):
        label_detection.main(["--runs", str(tmp_path), "--out", str(tmp_path / "out")])


@needs_fashion_mnist
@pytest.mark.slow
def test_the_module_on_a_tiny_run(tmp_path, capsys):
    from raysb.api import train
    from raysb.config import TrainConfig

    run = tmp_path / "run"
    train(TrainConfig.from_dict(dict(
        dataset="fashion-mnist", subset=600, test_subset=200, label_noise=0.2, strategy="free-sb", epochs=3,
        batch_size=50, model_options={"width": 4}, progress_seconds=0, record_analysis=False, out=str(run),
        device="cpu", strategy_options={"label_doubt": "probe"})), log=lambda _: None)
    out = tmp_path / "out"
    argv = ["--runs", str(run), "--folds", "2", "--fold-epochs", "1", "--out", str(out)]
    assert label_detection.main(argv) == 0
    markdown = (out / "label_detection.md").read_text()
    assert "raysb free-sb, label_doubt probe" in markdown and "cleanlab find_label_issues (2-fold" in markdown
    assert " ".join(argv) in markdown and markdown.strip() in capsys.readouterr().out
    with (out / "label_detection.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [row["method"].split()[0] for row in rows] == ["raysb", "cleanlab"]
    for row in rows:
        for key in ("precision", "recall", "f1", "estimated_share"):
            value = float(row[key])
            assert math.isnan(value) or 0 <= value <= 1, (row["method"], key, value)
        assert float(row["recall"]) >= 0 and float(row["true_share"]) == pytest.approx(0.2)
    cleanlab = rows[1]
    # 2 fold models, each 1 epoch on about half: about 1 epoch, and a forward at 1/3.
    assert 1.0 < float(cleanlab["work_epochs"]) < 1.4
    assert len(list(out.glob("cleanlab-*/fold-*.npz"))) == 2 and list(out.glob("cleanlab-*/pred_probs.npy"))
    # A rerun reads the folds back instead of training them again.
    before = {path: path.stat().st_mtime_ns for path in out.glob("cleanlab-*/fold-*.npz")}
    assert label_detection.main(argv) == 0
    assert before == {path: path.stat().st_mtime_ns for path in out.glob("cleanlab-*/fold-*.npz")}
    with (out / "label_detection.csv").open() as file:
        assert list(csv.DictReader(file)) == rows
