"""Data as people hold it (README, "Data"): images of mixed sizes, refused naming the sizes and the
option, train with image_size (resized as torchvision's Resize does); NumPy arrays load directly and
convert with to-parquet; to-parquet takes --set for a file's own column names and image_size; a
--data-dir that does not exist says so. Each through `raysb.cli.main` or the loaders, on small files
in the real formats, written here."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchvision.transforms import v2

from raysb.cli import main
from raysb.config import ConfigError
from raysb.data import DATASET_NAMES, load_splits

from test_data import encoded, tiny_mnist

TRAIN_QUICKLY = ["--epochs", "1", "--batch-size", "8", "--set", "record_analysis=false", "--progress-seconds", "0"]


def torchvision_resize(images: torch.Tensor, size: int) -> torch.Tensor:
    return v2.Resize((size, size), antialias=True)(images)


def image_folder(root, sizes, channels=3, per_split=(12, 4)) -> dict[str, list[torch.Tensor]]:
    """An ImageFolder of 2 classes whose images take the `sizes` in turn; the images of each split, in file order."""
    generator = torch.Generator().manual_seed(0)
    written = {}
    for split, count in zip(("train", "test"), per_split):
        images = {}
        for row in range(count):
            size = sizes[row % len(sizes)]
            path = root / split / f"class{row % 2}" / f"{row:02d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            images[path] = torch.randint(0, 256, (channels, size, size), dtype=torch.uint8, generator=generator)
            path.write_bytes(encoded(images[path]))
        written[split] = [images[path] for path in sorted(images)]
    return written


def one_error_line(capsys) -> str:
    error = capsys.readouterr().err
    assert error.startswith("raysb: error: ") and error.count("\n") == 1, error
    return error.removeprefix("raysb: error: ").rstrip("\n")


def test_images_of_mixed_sizes_are_refused_naming_the_sizes_and_train_resized_with_image_size(tmp_path, capsys):
    images = image_folder(tmp_path / "pets", sizes=(8, 8, 12))
    train = ["train", "--dataset", "imagefolder", "--data-dir", str(tmp_path / "pets"), *TRAIN_QUICKLY]
    assert main([*train, "--out", str(tmp_path / "refused")]) == 2
    assert one_error_line(capsys).startswith(
        f"images of 2 sizes: 8x8 in 8 (e.g. {tmp_path / 'pets/train/class0/00.png'}), 12x12 in 4 "
        f"(e.g. {tmp_path / 'pets/train/class0/02.png'}); set image_size to resize every image to one size "
        "(--image-size N or --set image_size=N, or image_size: N in YAML)")

    assert main([*train, "--image-size", "10", "--out", str(tmp_path / "resized")]) == 0
    train_split, test_split = load_splits("imagefolder", str(tmp_path / "pets"), image_size=10)
    assert train_split.images.shape == (12, 3, 10, 10) and test_split.images.shape == (4, 3, 10, 10)
    expected = torch.stack([torchvision_resize(image, 10) for image in images["train"]])
    assert torch.equal(train_split.images, expected)


def test_image_size_resizes_a_format_of_one_size_and_test_images_of_another(tmp_path, capsys):
    splits = tiny_mnist(tmp_path)  # 7x5 images
    train, _ = load_splits("mnist", str(tmp_path), image_size=6)
    assert torch.equal(train.images, torchvision_resize(torch.from_numpy(splits["train"][0]).unsqueeze(1), 6))

    # A test split of another size than train's is refused with the same remedy.
    image_folder(tmp_path / "pets", sizes=(8,), per_split=(12, 0))
    for row in range(2):
        path = tmp_path / "pets" / "test" / f"class{row}" / "x.png"
        path.parent.mkdir(parents=True)
        path.write_bytes(encoded(torch.zeros(3, 9, 9, dtype=torch.uint8)))
    with pytest.raises(ConfigError,
                       match=r"test images are \(3, 9, 9\) but train images are \(3, 8, 8\); set image_size"):
        load_splits("imagefolder", str(tmp_path / "pets"))


def test_numpy_arrays_load_directly_train_and_convert_with_to_parquet(tmp_path, capsys):
    generator = np.random.default_rng(0)
    arrays = {split: (generator.integers(0, 256, (n, 6, 6, 3), dtype=np.uint8), np.arange(n) % 3)
              for split, n in (("train", 24), ("test", 6))}
    for split, (images, labels) in arrays.items():  # channels last, as NumPy, PIL and Keras hold images
        np.savez(tmp_path / f"{split}.npz", images=images, labels=labels)
    train, test = load_splits("numpy", str(tmp_path))
    assert torch.equal(train.images, torch.from_numpy(arrays["train"][0]).permute(0, 3, 1, 2))
    assert train.labels.tolist() == arrays["train"][1].tolist() and train.num_classes == 3 and len(test) == 6

    assert main(["train", "--dataset", "numpy", "--data-dir", str(tmp_path), *TRAIN_QUICKLY,
                 "--out", str(tmp_path / "run")]) == 0
    assert main(["to-parquet", "--dataset", "numpy", "--data-dir", str(tmp_path), "--out", str(tmp_path / "pq")]) == 0
    converted, _ = load_splits("parquet", str(tmp_path / "pq"))
    assert torch.equal(converted.images, train.images) and torch.equal(converted.labels, train.labels)

    # .npy files: grey images (N, H, W) with labels (N, 1), as Keras saves them.
    grey = tmp_path / "grey"
    grey.mkdir()
    for split, (images, labels) in arrays.items():
        np.save(grey / f"{split}_images.npy", images[..., 0])
        np.save(grey / f"{split}_labels.npy", labels[:, None].astype(np.int32))
    train, _ = load_splits("numpy", str(grey), image_size=4)
    assert torch.equal(train.images, torchvision_resize(torch.from_numpy(arrays["train"][0][:, None, :, :, 0]), 4))


@pytest.mark.parametrize(("arrays", "message"), [
    ({"images": np.zeros((4, 6, 6), np.float32), "labels": np.arange(4)},
     r"train.npz: images are float32; raysb trains on uint8 pixels 0..255 \(for floats in \[0, 1\]: save "
     r"\(images \* 255\).round\(\).astype\(np.uint8\)\)"),
    # 16-bit pixels: told their range and how to rescale them, not about floats (test_the_rescale_...).
    ({"images": np.full((4, 6, 6), 4095, np.int16), "labels": np.arange(4)},
     r"train.npz: images are int16 with pixels from 4095 to 4095; raysb trains on uint8 pixels 0..255: rescale "
     r"them to it, e.g. \(\(images - L\) \* \(255 / \(M - L\)\)\).round\(\).astype\(np.uint8\), L and M the "
     r"least and largest values your pixels can take \(0 and 65535 for 16-bit images\), the same for every split"),
    ({"images": np.zeros((4, 6, 6), np.uint8), "labels": np.arange(3)},
     r"train.npz: labels must be 4 integers, one per image, \(N,\) or \(N, 1\); got int64 of shape \(3,\)"),
    ({"pixels": np.zeros((4, 6, 6), np.uint8), "labels": np.arange(4)},
     r"train.npz: no array images; it holds pixels, labels; save it as np.savez\(path, images=..., labels=...\)"),
    ({"images": np.zeros((4, 6, 6, 5), np.uint8), "labels": np.arange(4)},
     r"train.npz: images of shape \(4, 6, 6, 5\); give \(N, H, W\), \(N, H, W, C\) or \(N, C, H, W\)"),
    ({"images": np.zeros((4, 6, 6), np.uint8), "labels": np.array([0, 1, 0, 99])},
     r"train.npz: labels go up to 99 but only 3 distinct labels occur.*train.npz as num_classes"),
    ({"images": np.array([None] * 4), "labels": np.arange(4)}, r"train.npz: not NumPy arrays raysb reads"),
])
def test_numpy_arrays_raysb_cannot_train_on_are_named(tmp_path, arrays, message):
    np.savez(tmp_path / "train.npz", **arrays)
    with pytest.raises(ConfigError, match=message):
        load_splits("numpy", str(tmp_path))


def test_the_rescale_the_16_bit_error_suggests_loads_the_images_it_refused(tmp_path):
    # It once suggested (images * 255 // images.max()), which overflows int16 and uint16: 4095 came out -2.
    pixels = np.array([0, 1000, 4095, 65535], np.uint16)
    images = np.broadcast_to(pixels[:, None, None], (4, 6, 6))
    low, high = 0, 65535  # L and M, as the message names them for 16-bit images
    for split in ("train", "test"):
        np.savez(tmp_path / f"{split}.npz", images=((images - low) * (255 / (high - low))).round().astype(np.uint8),
                 labels=np.arange(4))
    train, _ = load_splits("numpy", str(tmp_path))
    assert train.images[:, 0, 0, 0].tolist() == [0, 4, 16, 255]


def test_a_sparse_label_space_declared_in_the_npz_is_taken_and_images_of_one_colour_are_refused(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (4, 6, 6), dtype=np.uint8)
    for split in ("train", "test"):
        np.savez(tmp_path / f"{split}.npz", images=images, labels=np.array([0, 1, 0, 99]), num_classes=100)
    assert load_splits("numpy", str(tmp_path))[0].num_classes == 100

    np.savez(tmp_path / "train.npz", images=np.full((4, 6, 6), 7, np.uint8), labels=np.arange(4))
    with pytest.raises(ConfigError, match="numpy train split: every training pixel of channel 0 is 7: images of one "
                                          "colour hold nothing to learn"):
        load_splits("numpy", str(tmp_path))


def test_to_parquet_takes_set_for_a_files_own_columns_and_image_size(tmp_path, capsys):
    # A flat Parquet file of its own: raw pixels and targets, as a user's pipeline wrote it.
    pixels = torch.randint(0, 256, (8, 1, 5, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    table = pa.table({"pixels": pa.array(pixels.reshape(8, -1).numpy().tolist(), pa.list_(pa.uint8())),
                      "target": pa.array([0, 1] * 4)}, metadata={"raysb.image_shape": "1,5,5"})
    source = tmp_path / "mine"
    source.mkdir()
    for split in ("train", "test"):
        pq.write_table(table, source / f"{split}.parquet")
    convert = ["to-parquet", "--dataset", "parquet", "--data-dir", str(source), "--out", str(tmp_path / "pq")]

    assert main(convert) == 2
    assert "no column 'image'" in one_error_line(capsys)
    assert main([*convert, "--set", "parquet_columns.image=pixels", "--set", "parquet_columns.label=target",
                 "--set", "image_size=3"]) == 0
    written = pq.read_table(tmp_path / "pq" / "train.parquet")
    assert written.column_names == ["image", "label", "sample_id"]
    converted, _ = load_splits("parquet", str(tmp_path / "pq"))
    assert torch.equal(converted.images, torchvision_resize(pixels, 3)) and converted.labels.tolist() == [0, 1] * 4

    for assignment, line in [
        ("image_sise=3", "raysb to-parquet --set takes parquet_columns, image_size, not image_sise "
                         "(did you mean image_size?)"),
        ("lr=0.1", "raysb to-parquet --set takes parquet_columns, image_size, not lr"),
        ("image_size=big", "image_size in --set must be a whole number (or left out), got 'big'"),
    ]:
        assert main([*convert, "--set", assignment]) == 2
        assert one_error_line(capsys) == line
    assert main(["to-parquet", "--dataset", "mnist", "--data-dir", str(tmp_path), "--out", str(tmp_path / "x"),
                 "--set", "parquet_columns.image=pixels"]) == 2
    assert one_error_line(capsys) == "parquet_columns names the columns of dataset parquet, not of 'mnist'"


@pytest.mark.parametrize("name", [name for name in DATASET_NAMES if name != "fashion-mnist"])
def test_a_data_dir_that_does_not_exist_says_so(tmp_path, capsys, name):
    missing = tmp_path / "no-such-folder"
    assert main(["train", "--dataset", name, "--data-dir", str(missing), "--out", str(tmp_path / "run")]) == 2
    assert one_error_line(capsys).endswith(f": --data-dir {missing} does not exist")
    assert main(["to-parquet", "--dataset", name, "--data-dir", str(missing), "--out", str(tmp_path / "pq")]) == 2
    assert one_error_line(capsys).endswith(f": --data-dir {missing} does not exist")

    a_file = tmp_path / "train.parquet"
    a_file.write_bytes(b"")
    assert main(["train", "--dataset", name, "--data-dir", str(a_file), "--out", str(tmp_path / "run")]) == 2
    assert one_error_line(capsys).endswith(f": --data-dir {a_file} is a file; give the folder that holds the data")
