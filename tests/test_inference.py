"""A trained run as a model to use (README, "Outputs" and "Python API"): the run folder's model.json
and weights rebuild the network with its preprocessing (`raysb.load_model`), which reproduces the
run's own test error, and `raysb predict` writes the same predictions for images held as Parquet,
as a folder of image files or as NumPy arrays."""

import json
import shutil

import numpy as np
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

import raysb
from raysb.cli import main
from raysb.data import load_splits, stratified_subset, write_parquet

from conftest import needs_fashion_mnist
from test_data import encoded


def small_mlp(num_classes: int, in_channels: int, *, image_size: int, hidden: int = 16) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))


def write_images(folder, images: torch.Tensor, labels) -> list[str]:
    """Each image as a PNG in its class's folder; their paths under `folder`, in sorted order."""
    names = []
    for row, (image, label) in enumerate(zip(images, labels)):
        path = folder / f"class{int(label)}" / f"{row:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encoded(image))
        names.append(path.relative_to(folder).as_posix())
    return sorted(names)


@needs_fashion_mnist
def test_a_trained_run_loads_with_its_preprocessing_and_predicts_as_it_evaluated(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--strategy", "traditional", "--subset", "1000", "--test-subset", "300", "--epochs", "1",
                 "--batch-size", "50", "--set", "record_analysis=false", "--progress-seconds", "0",
                 "--out", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    full_train, full_test = load_splits("fashion-mnist")
    assert json.loads((run / "model.json").read_text()) == {
        "model": "small-cnn", "model_options": {}, "num_classes": 10, "image_shape": [1, 28, 28], "image_size": None,
        "mean": list(full_train.mean), "std": list(full_train.std),
    }

    model = raysb.load_model(run)
    assert isinstance(model, raysb.TrainedModel) and not model.training and not model.network.training
    test = stratified_subset(full_test, 300, seed=0)  # the run's --test-subset, as prepare_data draws it
    probabilities = model.probabilities(test.images, batch_size=64)
    predicted = probabilities.argmax(1)
    assert (predicted != test.labels).float().mean().item() == pytest.approx(summary["best_test_error"])

    # raysb predict: a Parquet file (ids: its sample_id column), written as CSV.
    write_parquet(test, tmp_path / "test.parquet")
    capsys.readouterr()
    assert main(["predict", str(run), "--data-dir", str(tmp_path / "test.parquet"), "--out",
                 str(tmp_path / "predictions.csv")]) == 0
    assert capsys.readouterr().out == f"wrote 300 predictions to {tmp_path / 'predictions.csv'}\n"
    table = pacsv.read_csv(tmp_path / "predictions.csv")
    assert table.column_names == ["id", "predicted_class", *(f"probability_{k}" for k in range(10))]
    assert table["id"].to_pylist() == test.sample_ids.tolist()
    assert table["predicted_class"].to_pylist() == predicted.tolist()
    written = np.stack([table[f"probability_{k}"].to_numpy() for k in range(10)], axis=1)
    np.testing.assert_allclose(written, probabilities.numpy(), rtol=1e-6)

    # A folder of image files in class folders (ids: their paths), written as Parquet.
    names = write_images(tmp_path / "images", test.images[:12], test.labels[:12])
    assert main(["predict", str(run), "--data-dir", str(tmp_path / "images"), "--out",
                 str(tmp_path / "from_images.parquet")]) == 0
    from_images = pq.read_table(tmp_path / "from_images.parquet").to_pydict()
    rows = [int(name.split("/")[1][:3]) for name in names]
    assert from_images["id"] == names and from_images["predicted_class"] == predicted[rows].tolist()

    # NumPy images as NumPy holds them, channels last (ids: positions).
    np.save(tmp_path / "images.npy", test.images[:12].permute(0, 2, 3, 1).numpy())
    assert main(["predict", str(run), "--data-dir", str(tmp_path / "images.npy"), "--out",
                 str(tmp_path / "from_arrays.csv")]) == 0
    from_arrays = pacsv.read_csv(tmp_path / "from_arrays.csv").to_pydict()
    assert from_arrays["id"] == list(range(12)) and from_arrays["predicted_class"] == predicted[:12].tolist()

    # What predict refuses, each in one line: no run, no such images, a format it does not write,
    # images of another size than the run trained on (it was trained without image_size).
    write_images(tmp_path / "large", torch.zeros(2, 1, 32, 32, dtype=torch.uint8), [0, 1])
    write_images(tmp_path / "rgb", torch.zeros(2, 3, 28, 28, dtype=torch.uint8), [0, 1])
    capsys.readouterr()
    for args, line in [
        ([str(tmp_path), "--data-dir", str(tmp_path / "test.parquet"), "--out", str(tmp_path / "p.csv")],
         f"{tmp_path} holds no model.json: give the --out folder of a raysb run"),
        ([str(run), "--data-dir", str(tmp_path / "nothing"), "--out", str(tmp_path / "p.csv")],
         f"--data-dir {tmp_path / 'nothing'} does not exist"),
        ([str(run), "--data-dir", str(tmp_path), "--out", str(tmp_path / "p.csv")],
         f"{tmp_path} holds a data set's splits (test.parquet): give the one to predict on, e.g. --data-dir "
         f"{tmp_path / 'test.parquet'}"),
        ([str(run), "--data-dir", str(tmp_path / "test.parquet"), "--out", str(tmp_path / "p.json")],
         f"--out {tmp_path / 'p.json'}: predictions are written to a .csv or .parquet file"),
        ([str(run), "--data-dir", str(tmp_path / "large"), "--out", str(tmp_path / "p.csv")],
         "images are (1, 32, 32) (C, H, W), but the run trained on (1, 28, 28)"),
        # Colour images for a grayscale model: told to convert them, not to resize them.
        ([str(run), "--data-dir", str(tmp_path / "rgb"), "--out", str(tmp_path / "p.csv")],
         "images have 3 channel(s), but the run trained on 1 ((1, 28, 28) as C, H, W); convert them (to grayscale"),
        ([str(run), "--data-dir", str(tmp_path / "test.parquet"), "--out", str(tmp_path / "p.csv"), "--set",
          "parquet_column.image=pixels"], "raysb predict --set takes parquet_columns, not parquet_column (did you "
                                          "mean parquet_columns?)"),
    ]:
        assert main(["predict", *args]) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"raysb: error: {line}") and error.count("\n") == 1, error

    # model.json edited by hand: one line naming the file and what is wrong, never a traceback from the
    # network or NaN probabilities written as predictions.
    edited = tmp_path / "edited"
    shutil.copytree(run, edited)
    info = json.loads((run / "model.json").read_text())
    info_file, weights_file = edited / "model.json", edited / "best_model.pt"
    for text, line in [
        ("{", f"{info_file}: not valid JSON (Expecting property name enclosed in double quotes, line 1 column 2)"),
        (json.dumps(info | {"image_shape": [3, 32, 32]}),
         f"{info_file}: mean must hold one finite number a channel (3, as image_shape says)"),
        (json.dumps(info | {"image_shape": [3, 32, 32], "mean": [0.5] * 3, "std": [0.25] * 3}),
         f"{weights_file} does not fit the network {info_file} describes (model 'small-cnn'"),
        (json.dumps(info | {"std": [0.0]}), f"{info_file}: std must be > 0 in every channel"),
        (json.dumps(info | {"num_classes": "ten"}), f"{info_file}: num_classes must be a whole number >= 2, got 'ten'"),
        (json.dumps({k: v for k, v in info.items() if k != "mean"}), f"{info_file}: missing mean"),
        (b"\xff\xfe{}", f"{info_file}: not valid JSON (not UTF-8 text: byte 0)"),
        # image_size 32 on 28 x 28 images once resized them to 32 and told the user to resize them to 28.
        (json.dumps(info | {"image_size": 32}), f"{info_file}: image_size 32 does not match image_shape [1, 28, 28]"),
        (json.dumps(info | {"model": "nosuch"}), f"{info_file}: unknown model 'nosuch'"),
        # torch names each of the 100 keys resnet18 has and small-cnn has not: the line gives the first few.
        (json.dumps(info | {"model": "resnet18"}), f"{weights_file} does not fit the network {info_file} describes "
                                                   "(model 'resnet18', options {}, 10 classes, images [1, 28, 28]): "
                                                   'Missing key(s) in state_dict: "stem.0.weight", '),
    ]:
        info_file.write_bytes(text if isinstance(text, bytes) else text.encode())
        assert main(["predict", str(edited), "--data-dir", str(tmp_path / "test.parquet"), "--out",
                     str(tmp_path / "p.csv")]) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"raysb: error: {line}") and error.count("\n") == 1 and len(error) < 600, error
    # Weights cut short, or not torch's at all: one line naming the file, not torch's zip-archive or KeyError.
    shutil.copy(run / "model.json", info_file)
    for damaged in ((run / "best_model.pt").read_bytes()[:1000], b"hello\n"):
        weights_file.write_bytes(damaged)
        assert main(["predict", str(edited), "--data-dir", str(tmp_path / "test.parquet"), "--out",
                     str(tmp_path / "p.csv")]) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"raysb: error: {weights_file} cannot be read as a network's weights (") and (
            error.endswith("): it is cut short, damaged or not a raysb run's weights; put back a copy of it\n")), error
    assert not (tmp_path / "p.csv").exists()


def test_an_own_network_trained_on_images_of_mixed_sizes_loads_with_its_resize(tmp_path):
    # Grey images of three sizes in an ImageFolder; image_size 8 resizes every one as it is read.
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 24), ("test", 8)):
        for row in range(count):
            size = (8, 12, 16)[row % 3]
            label = row % 2
            image = torch.randint(0, 128, (1, size, size), dtype=torch.uint8, generator=generator) + 120 * label
            path = tmp_path / "pets" / split / ("cat", "dog")[label] / f"{row:02d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(encoded(image))
    run = tmp_path / "run"
    assert main(["train", "--dataset", "imagefolder", "--data-dir", str(tmp_path / "pets"), "--set", "image_size=8",
                 "--model", "test_inference:small_mlp", "--set", "model_options.hidden=8", "--epochs", "2",
                 "--batch-size", "8", "--set", "record_analysis=false", "--progress-seconds", "0", "--out",
                 str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())

    model = raysb.load_model(run)
    assert (model.info.model, model.info.model_options, model.info.image_size) == ("test_inference:small_mlp",
                                                                                   {"hidden": 8}, 8)
    _, test = load_splits("imagefolder", str(tmp_path / "pets"), image_size=8)
    assert (model.probabilities(test.images).argmax(1) != test.labels).float().mean().item() == pytest.approx(
        summary["best_test_error"])

    # predict decodes the folder's images at their own sizes and resizes them as the run did.
    assert main(["predict", str(run), "--data-dir", str(tmp_path / "pets" / "test"), "--out",
                 str(tmp_path / "p.csv")]) == 0
    table = pacsv.read_csv(tmp_path / "p.csv").to_pydict()
    assert table["id"][:2] == ["cat/00.png", "cat/02.png"]
    assert table["predicted_class"] == model.probabilities(test.images).argmax(1).tolist()
