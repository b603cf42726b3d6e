import gzip
import io
import pickle
import struct
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.io
import torch
from PIL import Image

from raysb.data import (
    DATASET_NAMES,
    BatchTransform,
    DatasetNotFoundError,
    ImageDataset,
    flip_labels,
    load_dataset,
    load_splits,
    stratified_subset,
    write_parquet,
)
from raysb.data.streaming import inspect_splits

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


# ---------------------------------------------------------------- writers of the real on-disk formats


def idx_bytes(array: np.ndarray) -> bytes:
    """IDX: two zero bytes, type code 0x08 (uint8), number of dims, big-endian uint32 dims, then the data."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_idx(path: Path, array: np.ndarray, compress: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = idx_bytes(array)
    if compress:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def tiny_mnist(root: Path, compress: bool = True, train_labels=None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    splits = {}
    for split, prefix, n in (("train", "train", 30), ("test", "t10k", 10)):
        images = rng.integers(0, 256, size=(n, 7, 5), dtype=np.uint8)
        labels = np.arange(n, dtype=np.uint8) % 10
        if split == "train" and train_labels is not None:
            labels = np.asarray(train_labels, dtype=np.uint8)
        write_idx(root / f"{prefix}-images-idx3-ubyte", images, compress)
        write_idx(root / f"{prefix}-labels-idx1-ubyte", labels, compress)
        splits[split] = images, labels
    return splits


def encoded(image: torch.Tensor, format: str = "PNG", **options) -> bytes:
    """A uint8 (C, H, W) image as a file of `format` would hold it, written by Pillow (not raysb's encoder)."""
    array = image.permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(array[..., 0] if array.shape[2] == 1 else array).save(buffer, format=format, **options)
    return buffer.getvalue()


def write_pickle(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Protocol 2 is what the Python 2 era CIFAR batches use.
    path.write_bytes(pickle.dumps(obj, protocol=2))


def numpy_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scaled = images.astype(np.float64) / 255
    axes = (0, 2, 3)
    return scaled.mean(axis=axes), scaled.std(axis=axes)


def make_dataset(n=40, channels=3, size=8, num_classes=4, seed=0, ids=None) -> ImageDataset:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, channels, size, size), dtype=torch.uint8, generator=generator)
    labels = torch.arange(n) % num_classes
    return ImageDataset(
        images=images,
        labels=labels,
        sample_ids=torch.arange(n) if ids is None else ids,
        num_classes=num_classes,
        mean=(0.5,) * channels,
        std=(0.25,) * channels,
    )


# ---------------------------------------------------------------- IDX (MNIST, Fashion-MNIST)


def test_mnist_from_flat_gzip_idx_files(tmp_path):
    splits = tiny_mnist(tmp_path)
    train = load_dataset("mnist", "train", str(tmp_path))
    test = load_dataset("mnist", "test", str(tmp_path))

    train_images, train_labels = splits["train"]
    assert train.images.dtype == torch.uint8 and train.images.shape == (30, 1, 7, 5)
    assert train.images.is_contiguous()
    assert torch.equal(train.images[:, 0], torch.from_numpy(train_images))
    assert train.labels.dtype == torch.int64 and torch.equal(train.labels, torch.from_numpy(train_labels).long())
    assert torch.equal(train.sample_ids, torch.arange(30))
    assert train.num_classes == test.num_classes == 10
    assert torch.equal(test.images[:, 0], torch.from_numpy(splits["test"][0]))

    mean, std = numpy_stats(train_images[:, None])
    # Both splits carry the train statistics.
    for ds in (train, test):
        np.testing.assert_allclose(ds.mean, mean, rtol=1e-9)
        np.testing.assert_allclose(ds.std, std, rtol=1e-9)


def test_mnist_from_uncompressed_torchvision_layout(tmp_path):
    splits = tiny_mnist(tmp_path / "MNIST" / "raw", compress=False)
    test = load_dataset("mnist", "test", str(tmp_path))
    assert torch.equal(test.images[:, 0], torch.from_numpy(splits["test"][0]))


@pytest.mark.parametrize("damage", ["truncated payload", "truncated gzip stream", "bad magic"])
def test_corrupt_idx_file_raises_error_naming_the_file(tmp_path, damage):
    tiny_mnist(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    data = idx_bytes(np.zeros((30, 7, 5), dtype=np.uint8))
    if damage == "truncated payload":
        path.write_bytes(gzip.compress(data[:-10]))
    elif damage == "truncated gzip stream":
        path.write_bytes(gzip.compress(data)[:-20])
    else:
        path.write_bytes(gzip.compress(b"\x00\x00\x99\x03" + data[4:]))
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz"):
        load_dataset("mnist", "train", str(tmp_path))


def test_truncated_idx_message_says_truncated(tmp_path):
    tiny_mnist(tmp_path)
    data = idx_bytes(np.zeros((30, 7, 5), dtype=np.uint8))
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(data[:-1]))
    with pytest.raises(ValueError, match="truncated"):
        load_dataset("mnist", "train", str(tmp_path))


@pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(), reason="dataset-fashion-mnist is not installed")
def test_real_fashion_mnist_from_system_folder():
    train = load_dataset("fashion-mnist", "train")
    test = load_dataset("fashion-mnist", "test")
    assert train.images.shape == (60000, 1, 28, 28)
    assert test.images.shape == (10000, 1, 28, 28)
    assert train.num_classes == test.num_classes == 10
    assert torch.equal(torch.bincount(train.labels), torch.full((10,), 6000))
    assert torch.equal(torch.bincount(test.labels), torch.full((10,), 1000))
    # The widely quoted Fashion-MNIST statistics.
    assert train.mean[0] == pytest.approx(0.2860, abs=1e-4)
    assert train.std[0] == pytest.approx(0.3530, abs=1e-4)
    assert test.mean == train.mean


# ---------------------------------------------------------------- CIFAR


def test_cifar10_from_pickled_batches(tmp_path):
    rng = np.random.default_rng(1)
    folder = tmp_path / "cifar-10-batches-py"
    batches = [rng.integers(0, 256, size=(3, 3072), dtype=np.uint8) for _ in range(5)]
    for i, data in enumerate(batches, start=1):
        write_pickle(folder / f"data_batch_{i}", {"batch_label": f"batch {i}", "data": data, "labels": [i, 0, 9]})
    test_data = rng.integers(0, 256, size=(2, 3072), dtype=np.uint8)
    write_pickle(folder / "test_batch", {"data": test_data, "labels": [3, 4]})

    train = load_dataset("cifar10", "train", str(tmp_path))
    test = load_dataset("cifar10", "test", str(tmp_path))

    assert train.images.shape == (15, 3, 32, 32) and train.num_classes == 10
    # Batches are concatenated in order; each row is 1024 red, then green, then blue values, row-major.
    assert torch.equal(train.images[3, 1], torch.from_numpy(batches[1][0, 1024:2048].reshape(32, 32)))
    assert train.labels.tolist() == [label for i in range(1, 6) for label in (i, 0, 9)]
    assert torch.equal(train.sample_ids, torch.arange(15))
    assert test.labels.tolist() == [3, 4] and test.images.shape == (2, 3, 32, 32)
    np.testing.assert_allclose(test.mean, numpy_stats(np.concatenate(batches).reshape(-1, 3, 32, 32))[0])


def test_cifar100_uses_fine_labels(tmp_path):
    rng = np.random.default_rng(2)
    folder = tmp_path / "cifar-100-python"
    for split, n in (("train", 4), ("test", 2)):
        write_pickle(
            folder / split,
            {
                "data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
                "fine_labels": [99, 0, 50, 7][:n],
                "coarse_labels": [19, 0, 10, 1][:n],
            },
        )
    train = load_dataset("cifar100", "train", str(tmp_path))
    test = load_dataset("cifar100", "test", str(tmp_path))
    assert train.num_classes == 100
    assert train.labels.tolist() == [99, 0, 50, 7]
    assert test.labels.tolist() == [99, 0]


# ---------------------------------------------------------------- SVHN


def test_svhn_from_mat_maps_label_10_to_digit_0(tmp_path):
    rng = np.random.default_rng(3)
    x = {split: rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8) for split, n in (("train", 5), ("test", 3))}
    scipy.io.savemat(tmp_path / "train_32x32.mat", {"X": x["train"], "y": np.array([[10], [1], [9], [10], [5]], dtype=np.uint8)})
    scipy.io.savemat(tmp_path / "test_32x32.mat", {"X": x["test"], "y": np.array([[2], [10], [3]], dtype=np.uint8)})

    train = load_dataset("svhn", "train", str(tmp_path))
    test = load_dataset("svhn", "test", str(tmp_path))
    assert train.labels.tolist() == [0, 1, 9, 0, 5]
    assert test.labels.tolist() == [2, 0, 3]
    assert train.images.shape == (5, 3, 32, 32) and train.num_classes == 10
    # X is (H, W, C, N): pixel (row 4, column 7, green) of image 2.
    assert train.images[2, 1, 4, 7] == x["train"][4, 7, 1, 2]
    assert torch.equal(test.images, torch.from_numpy(x["test"]).permute(3, 2, 0, 1))


# ---------------------------------------------------------------- Parquet


@pytest.mark.parametrize("encoding", ["png", "raw"])
@pytest.mark.parametrize("channels", [1, 3])
def test_parquet_round_trip(tmp_path, encoding, channels):
    ids = torch.arange(40) * 7 + 1000
    train = make_dataset(channels=channels, ids=ids)
    test = make_dataset(n=12, channels=channels, seed=1)
    write_parquet(train, str(tmp_path / "train.parquet"), encoding=encoding)
    write_parquet(test, str(tmp_path / "test.parquet"), encoding=encoding)

    loaded_train = load_dataset("parquet", "train", str(tmp_path))
    loaded_test = load_dataset("parquet", "test", str(tmp_path))
    for original, loaded in ((train, loaded_train), (test, loaded_test)):
        assert torch.equal(loaded.images, original.images)
        assert torch.equal(loaded.labels, original.labels)
        assert torch.equal(loaded.sample_ids, original.sample_ids)
        assert loaded.num_classes == original.num_classes
        np.testing.assert_allclose(loaded.mean, numpy_stats(train.images.numpy())[0])


def test_parquet_directory_without_sample_ids_or_num_classes(tmp_path):
    ds = make_dataset(n=10, channels=1, num_classes=3)
    images = [encoded(img) for img in ds.images]
    (tmp_path / "train.parquet").mkdir()
    for part, rows in enumerate((slice(0, 6), slice(6, 10))):
        table = pa.table({"image": pa.array(images[rows], pa.binary()), "label": pa.array(ds.labels[rows].numpy(), pa.int32())})
        pq.write_table(table, tmp_path / "train.parquet" / f"part-{part}.parquet")

    loaded = load_dataset("parquet", "train", str(tmp_path))
    assert torch.equal(loaded.images, ds.images)
    assert torch.equal(loaded.sample_ids, torch.arange(10))
    assert loaded.labels.dtype == torch.int64
    assert loaded.num_classes == 3  # max label + 1


@pytest.mark.parametrize("encoding", ["png", "raw"])
def test_streamed_split_matches_the_in_memory_read(tmp_path, encoding):
    train, test = make_dataset(n=40, ids=torch.arange(40) * 3 + 7), make_dataset(n=12, seed=1)
    for part, rows in enumerate(torch.arange(40).chunk(2)):
        write_parquet(train.select(rows), str(tmp_path / "train.parquet" / f"part-{part}.parquet"), encoding=encoding)
    write_parquet(test, str(tmp_path / "test.parquet"), encoding=encoding)

    streamed_train, streamed_test = inspect_splits(str(tmp_path))
    in_memory = load_dataset("parquet", "train", str(tmp_path))
    assert len(streamed_train) == 40 and torch.equal(streamed_train.sample_ids, train.sample_ids)
    assert streamed_train.image_shape == (3, 8, 8) and streamed_train.num_classes == 4
    np.testing.assert_allclose(streamed_train.mean, in_memory.mean)
    assert streamed_test.mean == streamed_train.mean  # test data is normalized with train statistics
    pieces = list(streamed_test.batches(5))
    assert [len(labels) for _, labels in pieces] == [5, 5, 2]
    assert torch.equal(torch.cat([images for images, _ in pieces]), test.images)
    assert torch.equal(torch.cat([labels for _, labels in pieces]), test.labels)


def test_to_parquet_command_writes_a_streamable_copy(tmp_path):
    from raysb.cli import main

    source = tmp_path / "source"
    write_parquet(make_dataset(n=30, ids=torch.arange(30) + 500), str(source / "train.parquet"))
    write_parquet(make_dataset(n=9, seed=1), str(source / "test.parquet"))
    out = tmp_path / "copy"
    args = ["to-parquet", "--dataset", "parquet", "--data-dir", str(source), "--out", str(out), "--files", "3"]
    assert main(args) == 0
    assert len(list((out / "train.parquet").glob("part-*.parquet"))) == 3
    train, test = inspect_splits(str(out))
    assert torch.equal(train.sample_ids, torch.arange(30) + 500) and len(test) == 9
    assert main([*args[:-2], "--subset", "1000"]) == 2  # more than the split holds: a clear error


def test_streaming_needs_matching_splits_and_the_id_column_it_is_told_of(tmp_path):
    write_parquet(make_dataset(n=10), str(tmp_path / "train.parquet"))
    write_parquet(make_dataset(n=10, size=6), str(tmp_path / "test.parquet"))
    with pytest.raises(ValueError, match=r"test images are \(3, 6, 6\) but train images are \(3, 8, 8\)"):
        inspect_splits(str(tmp_path))
    ds = make_dataset(n=10, size=6)
    images = [encoded(img) for img in ds.images]
    _write_table(tmp_path / "train.parquet", {"image": pa.array(images, pa.binary()), "label": pa.array(ds.labels.numpy())})
    # No id column: ids are row positions, as in memory (it was once refused streamed).
    assert torch.equal(inspect_splits(str(tmp_path))[0].sample_ids, torch.arange(10))
    # A column named as the ids must be there.
    with pytest.raises(ValueError, match=r"no column 'row_id' \(parquet_columns.sample_id\); found \['image', 'label'\]"):
        inspect_splits(str(tmp_path), {"sample_id": "row_id"})


def _write_table(path: Path, columns: dict, metadata=None) -> None:
    pq.write_table(pa.table(columns, metadata=metadata), path)


def test_parquet_missing_column_suggests_parquet_columns(tmp_path):
    _write_table(tmp_path / "train.parquet", {"image": pa.array([b"x"]), "target": pa.array([0])})
    suggestion = r"no column 'label'; found \['image', 'target'\]; .*--set parquet_columns.label=COLUMN"
    with pytest.raises(ValueError, match=suggestion):
        load_dataset("parquet", "train", str(tmp_path))


def test_parquet_images_of_unequal_shape(tmp_path):
    images = [encoded(torch.zeros(1, 4, 4, dtype=torch.uint8)), encoded(torch.zeros(1, 5, 4, dtype=torch.uint8))]
    _write_table(tmp_path / "train.parquet", {"image": pa.array(images, pa.binary()), "label": pa.array([0, 1])})
    with pytest.raises(ValueError, match=r"images of 2 sizes: 4x4 in 1 \(e.g. .*row 0\), 5x4 in 1 \(e.g. .*row 1\); "
                                         r"set image_size to resize every image to one size"):
        load_dataset("parquet", "train", str(tmp_path))


def test_parquet_raw_images_of_wrong_length(tmp_path):
    _write_table(
        tmp_path / "train.parquet",
        {"image": pa.array([[0] * 4, [0] * 3], pa.list_(pa.uint8())), "label": pa.array([0, 1])},
        metadata={"raysb.image_shape": "1,2,2"},
    )
    with pytest.raises(ValueError, match="unequal shape"):
        load_dataset("parquet", "train", str(tmp_path))


def test_parquet_duplicate_sample_ids(tmp_path):
    ds = make_dataset(n=4, ids=torch.tensor([5, 6, 5, 7]))
    write_parquet(ds, tmp_path / "train.parquet")
    with pytest.raises(ValueError, match=r"column 'sample_id': 1 duplicate sample ids, e.g. \[5\]"):
        load_dataset("parquet", "train", str(tmp_path))


# ---------------------------------------------------------------- errors common to all loaders


@pytest.mark.parametrize("name", ["mnist", "cifar10", "cifar100", "svhn", "parquet"])
def test_missing_files_raise_dataset_not_found_naming_the_path(tmp_path, name):
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset(name, "train", str(tmp_path), download=False)
    assert isinstance(info.value, FileNotFoundError)
    message = str(info.value)
    assert str(tmp_path) in message and "--data-dir" in message


def test_fashion_mnist_reads_the_data_dir_it_is_given_and_names_one_that_does_not_exist(tmp_path):
    # It once read the system's copy first, so a --data-dir mistyped (or pointing at other files)
    # trained on the system's data and said nothing.
    splits = tiny_mnist(tmp_path / "mine")
    own = load_dataset("fashion-mnist", "train", str(tmp_path / "mine"))
    assert own.images.shape == (30, 1, 7, 5) and np.array_equal(own.images[:, 0].numpy(), splits["train"][0])
    with pytest.raises(DatasetNotFoundError, match=f"fashion-mnist: --data-dir {tmp_path / 'no-such'} does not exist"):
        load_dataset("fashion-mnist", "train", str(tmp_path / "no-such"))


def test_not_found_message_lists_files_and_fixes(tmp_path):
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("mnist", "test", str(tmp_path))
    message = str(info.value)
    assert "t10k-images-idx3-ubyte[.gz]" in message and "t10k-labels-idx1-ubyte[.gz]" in message
    assert str(tmp_path / "MNIST" / "raw") in message
    assert "download" in message
    assert "--data-dir (data_dir= in Python)" in message  # the CLI's flag, and the Python API's key


def test_not_found_without_data_dir(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="no data_dir"):
        load_dataset("cifar10", "train")


def test_labels_out_of_range_raise(tmp_path):
    tiny_mnist(tmp_path, train_labels=[12] * 3 + list(range(10)) * 2 + [0] * 7)
    with pytest.raises(ValueError, match=r"mnist train.*3 labels outside \[0, 10\).*12 \(3 times\)"):
        load_dataset("mnist", "train", str(tmp_path))


def test_parquet_label_beyond_declared_num_classes_raises(tmp_path):
    ds = make_dataset(n=8, num_classes=4)
    write_parquet(ds, tmp_path / "train.parquet")
    bad = ImageDataset(ds.images, torch.tensor([0, 1, 2, 3, -1, 4, 4, 0]), ds.sample_ids, 4, ds.mean, ds.std)
    write_parquet(bad, tmp_path / "test.parquet")
    with pytest.raises(ValueError, match=r"parquet test.*-1 \(1 times\), 4 \(2 times\)"):
        load_dataset("parquet", "test", str(tmp_path))


def test_unknown_name_and_split():
    with pytest.raises(ValueError, match="valid names: " + ", ".join(DATASET_NAMES)):
        load_dataset("imagenet", "train")
    with pytest.raises(ValueError, match="split"):
        load_dataset("mnist", "validation")


# ---------------------------------------------------------------- ImageDataset, subsets, label noise


def test_select_keeps_ids_and_statistics():
    ds = make_dataset(ids=torch.arange(40) + 100)
    picked = ds.select(torch.tensor([5, 2, 30]))
    assert picked.sample_ids.tolist() == [105, 102, 130]
    assert torch.equal(picked.images[1], ds.images[2])
    assert picked.mean == ds.mean and picked.num_classes == ds.num_classes and len(picked) == 3


def imbalanced_dataset() -> ImageDataset:
    # Classes of 50, 30, 15 and 5 examples, interleaved.
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 15 + [3] * 5)
    labels = labels[torch.randperm(100, generator=torch.Generator().manual_seed(0))]
    ds = make_dataset(n=100)
    return ImageDataset(ds.images, labels, ds.sample_ids + 10_000, 4, ds.mean, ds.std)


@pytest.mark.parametrize("size", [4, 7, 33, 61, 100])
def test_stratified_subset_keeps_class_proportions(size):
    ds = imbalanced_dataset()
    subset = stratified_subset(ds, size, seed=0)
    assert len(subset) == size
    expected = torch.bincount(ds.labels, minlength=4).double() * size / len(ds)
    got = torch.bincount(subset.labels, minlength=4).double()
    assert (got - expected).abs().max() < 1
    # Rows are real rows of ds: the id still points at the same image and label.
    rows = subset.sample_ids - 10_000
    assert torch.equal(ds.images[rows], subset.images) and torch.equal(ds.labels[rows], subset.labels)
    assert len(torch.unique(subset.sample_ids)) == size


def test_stratified_subset_is_deterministic_per_seed():
    ds = imbalanced_dataset()
    first, again, other = (stratified_subset(ds, 30, seed) for seed in (1, 1, 2))
    assert torch.equal(first.sample_ids, again.sample_ids)
    assert not torch.equal(first.sample_ids, other.sample_ids)


@pytest.mark.parametrize("size", [3, 101])
def test_stratified_subset_rejects_bad_size(size):
    with pytest.raises(ValueError):
        stratified_subset(imbalanced_dataset(), size, seed=0)


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.25, 0.5, 0.999])
def test_flip_labels_flips_exact_count_to_other_classes(fraction):
    ds = make_dataset(n=200, num_classes=10, ids=torch.arange(200) * 3)
    noisy, flipped_ids = flip_labels(ds, fraction, seed=0)
    changed = noisy.labels != ds.labels
    assert int(changed.sum()) == round(fraction * 200)
    assert torch.equal(torch.sort(flipped_ids).values, ds.sample_ids[changed])
    assert noisy.labels.min() >= 0 and noisy.labels.max() < 10
    assert torch.equal(noisy.images, ds.images) and torch.equal(noisy.sample_ids, ds.sample_ids)
    assert torch.equal(ds.labels, torch.arange(200) % 10)  # the input is left alone


def test_flip_labels_is_deterministic_and_spreads_over_classes():
    ds = make_dataset(n=2000, num_classes=5)
    a, ids_a = flip_labels(ds, 0.5, seed=3)
    b, ids_b = flip_labels(ds, 0.5, seed=3)
    assert torch.equal(a.labels, b.labels) and torch.equal(ids_a, ids_b)
    changed = a.labels != ds.labels
    # Every wrong class is used (the new class is uniform over the other four).
    pairs = torch.unique(ds.labels[changed] * 5 + a.labels[changed])
    assert len(pairs) == 5 * 4


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 1.5])
def test_flip_labels_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError):
        flip_labels(make_dataset(), fraction, seed=0)


# ---------------------------------------------------------------- BatchTransform


def test_transform_normalizes_with_dataset_statistics(tmp_path):
    tiny_mnist(tmp_path)
    train = load_dataset("mnist", "train", str(tmp_path))
    out = BatchTransform(train.mean, train.std, crop_padding=4, horizontal_flip=True, cutout_length=3)(
        train.images, torch.Generator().manual_seed(0), train=False
    )
    assert out.dtype == torch.float32 and out.shape == train.images.shape
    assert out.mean().item() == pytest.approx(0, abs=1e-5)
    assert out.std(unbiased=False).item() == pytest.approx(1, abs=1e-5)
    # Without training, nothing random happens: the transform is plain normalization.
    expected = (train.images.double() / 255 - train.mean[0]) / train.std[0]
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def as_pixels(normalized: torch.Tensor) -> torch.Tensor:
    """Undo mean 0 / std 1/255 normalization exactly, so outputs compare equal to pixel values."""
    pixels = normalized.round()
    torch.testing.assert_close(normalized, pixels, atol=1e-3, rtol=0)
    return pixels


def test_random_crop_keeps_shape_and_shifts_content():
    images = torch.randint(1, 256, (64, 3, 10, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    transform = BatchTransform((0.0,) * 3, (1 / 255,) * 3, crop_padding=2)
    out = transform(images, torch.Generator().manual_seed(0), train=True)
    assert out.shape == images.shape
    out = as_pixels(out)
    # Padding shows up as black pixels.
    assert (out == 0).any()
    for img, crop in zip(images.float(), out):
        padded = torch.nn.functional.pad(img, (2, 2, 2, 2))
        windows = padded.unfold(1, 10, 1).unfold(2, 12, 1)  # (C, 5, 5, 10, 12): every possible crop
        assert any(torch.equal(windows[:, dy, dx], crop) for dy in range(5) for dx in range(5))


def test_horizontal_flip_mirrors_about_half_the_images():
    images = torch.randint(0, 256, (64, 1, 5, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    transform = BatchTransform((0.0,), (1 / 255,), horizontal_flip=True)
    out = as_pixels(transform(images, torch.Generator().manual_seed(0), train=True))
    original, mirrored = images.float(), images.float().flip(3)
    is_mirrored = (out == mirrored).flatten(1).all(1)
    is_original = (out == original).flatten(1).all(1)
    assert (is_mirrored | is_original).all()
    assert 10 < int(is_mirrored.sum()) < 54
    assert torch.equal(out[is_mirrored][0, 0, :, 0], original[is_mirrored][0, 0, :, -1])


@pytest.mark.parametrize("padding, flip", [(2, True), (2, False), (0, True), (3, True)])
def test_crop_and_flip_equal_cropping_then_mirroring_each_image_by_the_same_draws(padding, flip):
    images = torch.randint(0, 256, (40, 3, 7, 9), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    transform = BatchTransform((0.0,) * 3, (1 / 255,) * 3, crop_padding=padding, horizontal_flip=flip)
    out = as_pixels(transform(images, torch.Generator().manual_seed(5), train=True))
    # The draws in their order: each image's row and column offsets, then whether each is mirrored.
    draws = torch.Generator().manual_seed(5)
    offsets = torch.randint(2 * padding + 1, (2, 40), generator=draws) if padding else torch.zeros(2, 40, dtype=torch.long)
    mirrored = torch.randint(2, (40,), generator=draws) if flip else torch.zeros(40, dtype=torch.long)
    for image, got, top, left, mirror in zip(images.float(), out, offsets[0], offsets[1], mirrored):
        padded = torch.nn.functional.pad(image, (padding,) * 4)
        expected = padded[:, top:top + 7, left:left + 9]
        assert torch.equal(got, expected.flip(2) if mirror else expected)
    assert 0 < int(mirrored.sum()) < 40 or not flip


def test_cutout_sets_a_square_to_the_mean():
    images = torch.full((200, 2, 20, 20), 200, dtype=torch.uint8)
    transform = BatchTransform((0.5, 0.5), (0.2, 0.2), cutout_length=6)
    out = transform(images, torch.Generator().manual_seed(0), train=True)
    untouched = (200 / 255 - 0.5) / 0.2
    zero = out == 0
    assert torch.allclose(out[~zero], torch.tensor(untouched))
    assert torch.equal(zero[:, 0], zero[:, 1])  # one square per image, across all channels
    full_squares = 0
    for mask in zero[:, 0]:
        rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
        # A (possibly border-clipped) rectangle of side at most 6.
        assert len(rows) <= 6 and len(cols) <= 6
        assert int(mask.sum()) == len(rows) * len(cols)
        full_squares += int(len(rows) == len(cols) == 6)
    assert full_squares > 50


def test_same_seed_same_augmentation():
    images = torch.randint(0, 256, (32, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    transform = BatchTransform((0.4, 0.5, 0.6), (0.2, 0.25, 0.3), crop_padding=4, horizontal_flip=True, cutout_length=8)
    first = transform(images, torch.Generator().manual_seed(7), train=True)
    again = transform(images, torch.Generator().manual_seed(7), train=True)
    other = transform(images, torch.Generator().manual_seed(8), train=True)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


# ---------------------------------------------------------------- your own Parquet, as a user writes it


USERS_NAMES = {"image": "pixels", "label": "target", "sample_id": "row_id"}
# The image encodings README names: PNG and JPEG bytes, and a flat uint8 list with its shape in metadata.
USERS_FORMATS = ("png", "jpeg", "uint8-list")


def decoded_by_pillow(data: bytes) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as image:
        array = np.array(image)
    return torch.from_numpy(array[None] if array.ndim == 2 else array.transpose(2, 0, 1).copy())


def users_table(data: ImageDataset, image_format: str) -> tuple[pa.Table, torch.Tensor]:
    """`data` as a user's own tool writes it (columns pixels, target, row_id, and an unrelated string
    column named `label`), with the images in `image_format`; and the images raysb must read from it."""
    metadata = None
    if image_format == "uint8-list":
        pixels = pa.array([image.reshape(-1).tolist() for image in data.images], pa.list_(pa.uint8()))
        metadata = {"raysb.image_shape": ",".join(map(str, data.images.shape[1:]))}
        expected = data.images
    else:
        files = [encoded(image, image_format.upper()) for image in data.images]
        pixels = pa.array(files, pa.binary())
        # JPEG is lossy: what raysb reads must be what Pillow, an independent decoder, reads.
        expected = torch.stack([decoded_by_pillow(f) for f in files])
    columns = {
        "row_id": pa.array(data.sample_ids.numpy()),
        "pixels": pixels,
        "target": pa.array(data.labels.numpy().astype(np.int32)),
        "label": pa.array(["a note"] * len(data)),
    }
    return pa.table(columns, metadata=metadata), expected


def write_users_splits(folder: Path, image_format: str) -> tuple[ImageDataset, torch.Tensor, torch.Tensor]:
    """(train, its expected images, the test split's expected images); the train split a folder of two files."""
    train, test = make_dataset(n=24, ids=torch.arange(24) * 5 + 3), make_dataset(n=8, seed=1, ids=torch.arange(8))
    table, expected_train = users_table(train, image_format)
    (folder / "train.parquet").mkdir()
    pq.write_table(table.slice(0, 10), folder / "train.parquet" / "part-0.parquet")
    pq.write_table(table.slice(10), folder / "train.parquet" / "part-1.parquet")
    table, expected_test = users_table(test, image_format)
    pq.write_table(table, folder / "test.parquet")
    return train, expected_train, expected_test


@pytest.mark.parametrize("image_format", USERS_FORMATS)
def test_users_own_parquet_with_parquet_columns_in_memory_and_streamed(tmp_path, image_format):
    # The user's case: a flat list<uint8> column with raysb.image_shape read under parquet_columns
    # failed in memory ("raw uint8 images need the C,H,W shape in schema metadata").
    train, expected_train, expected_test = write_users_splits(tmp_path, image_format)

    loaded_train, loaded_test = load_splits("parquet", str(tmp_path), parquet_columns=USERS_NAMES)
    assert torch.equal(loaded_train.images, expected_train) and torch.equal(loaded_test.images, expected_test)
    assert torch.equal(loaded_train.labels, train.labels) and torch.equal(loaded_train.sample_ids, train.sample_ids)
    assert loaded_train.num_classes == 4

    streamed_train, streamed_test = inspect_splits(str(tmp_path), USERS_NAMES)
    assert torch.equal(streamed_train.sample_ids, train.sample_ids) and streamed_train.num_classes == 4
    assert streamed_train.image_shape == (3, 8, 8)
    np.testing.assert_allclose(streamed_train.mean, loaded_train.mean)
    assert torch.equal(torch.cat([images for images, _ in streamed_test.batches(5)]), expected_test)


@pytest.mark.slow
def test_ray_data_streams_the_users_own_parquet(ray_session, tmp_path):
    # Raw uint8 lists: their shape comes from the split's metadata, which a read task's piece lacks.
    # (Encoded images take the same column selection and decoding; tests/test_object_storage.py streams PNG.)
    from raysb.data.streaming import ray_dataset

    train, expected_train, _ = write_users_splits(tmp_path, "uint8-list")
    split, _ = inspect_splits(str(tmp_path), USERS_NAMES)
    dataset = ray_dataset(split)
    # Read through the datasource that plans the read once, not one listing the files again each
    # epoch (4-6 s an epoch: BENCHMARKS.md, "Streamed epochs"), and only for raysb's own read.
    assert not dataset._logical_plan.dag.dag_str.startswith("ListFiles")
    assert ray_session.data.DataContext.get_current().use_datasource_v2 is True
    rows = {int(row["sample_id"]): row for row in dataset.take_all()}
    assert sorted(rows) == train.sample_ids.tolist()
    for position, sample_id in enumerate(train.sample_ids.tolist()):
        assert torch.equal(torch.from_numpy(np.array(rows[sample_id]["image"])), expected_train[position])
        assert int(rows[sample_id]["label"]) == int(train.labels[position])


def test_a_mapped_column_the_file_lacks_is_named_with_its_setting(tmp_path):
    write_users_splits(tmp_path, "png")
    with pytest.raises(ValueError, match=r"no column 'pixel' \(parquet_columns.image\); found \['row_id', 'pixels'"):
        load_dataset("parquet", "train", str(tmp_path), parquet_columns={**USERS_NAMES, "image": "pixel"})
    with pytest.raises(ValueError, match=r"no column 'pixel' \(parquet_columns.image\)"):
        inspect_splits(str(tmp_path), {**USERS_NAMES, "image": "pixel"})


def test_errors_name_the_users_own_columns(tmp_path):
    table, _ = users_table(make_dataset(n=6, channels=1), "uint8-list")
    path = tmp_path / "train.parquet"

    def in_memory():
        load_dataset("parquet", "train", str(tmp_path), parquet_columns=USERS_NAMES)

    def message(table: pa.Table, read=in_memory) -> str:
        pq.write_table(table, path)
        with pytest.raises(ValueError) as info:
            read()
        return str(info.value)

    no_shape = table.replace_schema_metadata(None)
    expected = "column 'pixels' holds raw uint8 lists, which need their C,H,W shape in schema metadata 'raysb.image_shape'"
    assert expected in message(no_shape)
    write_parquet(make_dataset(n=6, channels=1), tmp_path / "test.parquet")
    assert expected in message(no_shape, read=lambda: inspect_splits(str(tmp_path), USERS_NAMES))

    undecodable = message(table.set_column(1, "pixels", pa.array([b"\x89PNG\r\n\x1a\nbroken"] * 6, pa.binary())))
    assert "column 'pixels' row 0: not an image raysb decodes; images must be PNG, JPEG, WebP or GIF" in undecodable
    assert "raysb.image_shape" in undecodable and ".cpp" not in undecodable

    floats, strings = pa.array([0.5] * 6), pa.array(["a"] * 6)
    assert "column 'pixels' holds double; images must be PNG" in message(table.set_column(1, "pixels", floats))
    assert "column 'target' must hold integers, got string" in message(table.set_column(2, "target", strings))


# ---------------------------------------------------------------- the label space


def write_labelled(path: Path, labels: list[int], metadata: dict | None = None) -> None:
    """A split as a user's tool writes it: PNG images, integer labels, sample ids, no raysb metadata."""
    data = make_dataset(n=len(labels), channels=1)
    columns = {
        "image": pa.array([encoded(image) for image in data.images], pa.binary()),
        "label": pa.array(labels),
        "sample_id": pa.array(range(len(labels))),
    }
    _write_table(path, columns, metadata)


def test_a_stray_label_is_refused_unless_num_classes_says_so(tmp_path):
    # The user's case: one label of 99 in a 4-class set built a 100-class model without a word.
    labels = [i % 4 for i in range(20)]
    labels[7] = 99
    write_labelled(tmp_path / "train.parquet", labels)
    write_labelled(tmp_path / "test.parquet", [i % 4 for i in range(8)])
    refused = (
        r"train.parquet: labels go up to 99 but only 5 distinct labels occur \(0, 1, 2, 3, 99\): "
        r"a 100-class model would never see 95 of its classes.*raysb.num_classes"
    )
    with pytest.raises(ValueError, match=refused):
        load_dataset("parquet", "train", str(tmp_path))
    with pytest.raises(ValueError, match=refused):
        inspect_splits(str(tmp_path))

    write_labelled(tmp_path / "train.parquet", labels, metadata={"raysb.num_classes": "100"})
    assert load_dataset("parquet", "train", str(tmp_path)).num_classes == 100
    assert inspect_splits(str(tmp_path))[0].num_classes == 100

    write_labelled(tmp_path / "train.parquet", labels, metadata={"raysb.num_classes": "many"})
    with pytest.raises(ValueError, match=r"raysb.num_classes must be a positive integer, got b'many'"):
        load_dataset("parquet", "train", str(tmp_path))


def test_a_minus_one_label_is_named_as_such_whether_signed_or_wrapped_by_an_unsigned_column(tmp_path):
    # A new user's case: -1 marking unlabelled rows, written to a uint8 column, was reported only as
    # "labels go up to 255".
    labels = [i % 4 for i in range(20)]
    labels[5] = -1
    write_labelled(tmp_path / "test.parquet", [i % 4 for i in range(8)])
    write_labelled(tmp_path / "train.parquet", labels)
    with pytest.raises(ValueError, match=r"train split: 1 labels outside \[0, 4\): -1 \(1 times\)"):
        load_dataset("parquet", "train", str(tmp_path))
    data = make_dataset(n=len(labels), channels=1)
    _write_table(tmp_path / "train.parquet", {
        "image": pa.array([encoded(image) for image in data.images], pa.binary()),
        "label": pa.array(labels).cast(pa.uint8(), safe=False),
    }, None)
    with pytest.raises(ValueError, match=r"labels go up to 255 \(255 is what -1 becomes in an unsigned integer "
                                         r"column\).*drop unlabelled rows"):
        load_dataset("parquet", "train", str(tmp_path))


def test_labels_counted_from_one_and_a_test_split_of_few_classes_are_accepted(tmp_path):
    write_labelled(tmp_path / "train.parquet", [1 + i % 4 for i in range(20)])
    write_labelled(tmp_path / "test.parquet", [4, 4, 4])  # alone, one label of 5 would look stray
    train, test = load_splits("parquet", str(tmp_path))
    assert train.num_classes == test.num_classes == 5  # class 0 never occurs: 5 > 2 x 4 does not hold
    assert inspect_splits(str(tmp_path))[1].num_classes == 5


# ---------------------------------------------------------------- decoding


def decoded_as_before(data: bytes) -> torch.Tensor:
    """torchvision.io's decoder, which raysb used until torchvision 0.29 deprecated it: the reference here."""
    from torchvision.io import ImageReadMode, decode_image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.UNCHANGED)


@pytest.mark.parametrize(
    ("image_format", "channels"), [("PNG", 1), ("PNG", 2), ("PNG", 3), ("PNG", 4), ("JPEG", 1), ("JPEG", 3)]
)
def test_images_decode_to_the_pixels_torchvision_gave(tmp_path, image_format, channels):
    generator = torch.Generator().manual_seed(channels)
    images = torch.randint(0, 256, (6, channels, 9, 7), dtype=torch.uint8, generator=generator)
    files = [encoded(image, image_format) for image in images]
    _write_table(tmp_path / "train.parquet", {"image": pa.array(files, pa.binary()), "label": pa.array([0, 1] * 3)})
    loaded = load_dataset("parquet", "train", str(tmp_path)).images
    assert torch.equal(loaded, torch.stack([decoded_as_before(f) for f in files]))
    if image_format == "PNG":
        assert torch.equal(loaded, images)


def test_a_palette_png_decodes_to_its_colours(tmp_path):
    # torchvision gave the palette indices (one channel); a model wants the colours.
    colours = torch.randint(0, 256, (3, 9, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    palette = Image.fromarray(colours.permute(1, 2, 0).numpy()).convert("P")
    buffer = io.BytesIO()
    palette.save(buffer, format="PNG")
    _write_table(tmp_path / "train.parquet", {"image": pa.array([buffer.getvalue()], pa.binary()), "label": pa.array([0])})
    loaded = load_dataset("parquet", "train", str(tmp_path)).images[0]
    assert torch.equal(loaded, torch.from_numpy(np.array(palette.convert("RGB"))).permute(2, 0, 1))


def test_write_parquet_png_bytes_are_those_torchvision_wrote(tmp_path):
    data = make_dataset(n=5, channels=3)
    write_parquet(data, tmp_path / "train.parquet")
    from torchvision.io import encode_png

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        before = [encode_png(image).numpy().tobytes() for image in data.images]
    assert pq.read_table(tmp_path / "train.parquet").column("image").to_pylist() == before


def test_a_memory_shard_names_a_chunks_ids_on_the_host_from_its_positions():
    from raysb.data.shards import MemoryShard

    # On a GPU the dataset's ids live on the device; the epoch's positions stay on the host,
    # and so do the ids asked for every round (a copy to the device would wait for it).
    shard = MemoryShard(make_dataset(n=40, ids=torch.arange(1000, 1040)))
    chunk = next(shard.epoch_chunks(16, torch.Generator().manual_seed(0)))
    ids = shard.sample_ids(chunk)
    assert ids.device == chunk.device and torch.equal(ids, 1000 + chunk)
    assert torch.equal(shard.raw(chunk).sample_ids, ids)


@pytest.mark.slow
def test_raw_parquet_needs_no_image_codec(tmp_path):
    """The GPU machines raysb benchmarks on have torch but no TorchCodec: raw uint8 Parquet, which
    their benchmarks write and read, must not import it."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torchcodec'] = None\n"
        "import torch\n"
        "from raysb.data import ImageDataset, load_dataset, write_parquet\n"
        "data = ImageDataset(torch.randint(0, 255, (8, 3, 4, 4), dtype=torch.uint8), torch.arange(8) % 2,\n"
        "                    torch.arange(8), 2, (0.5,) * 3, (0.2,) * 3)\n"
        f"write_parquet(data, r'{tmp_path}/train.parquet', encoding='raw')\n"
        f"loaded = load_dataset('parquet', 'train', r'{tmp_path}')\n"
        "assert torch.equal(loaded.images, data.images)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------- data as people hold it


def write_hugging_face_splits(
    folder: Path, train_rows: int = 12, files: int = 1, row_group_size: int | None = None, image: str = "image",
    splits: tuple[ImageDataset, ImageDataset] | None = None,
) -> tuple[ImageDataset, ImageDataset]:
    """train.parquet and test.parquet as Hugging Face `datasets` writes an Image feature: a struct of
    the encoded bytes and the path they came from, a label column, the library's own schema metadata,
    no id column. With `files` > 1 train.parquet is a folder of files named as on the Hub; the Image
    column may have another name (CIFAR-10's is `img`). `splits`: the (train, test) images to write,
    by default `train_rows` and 4 random ones. Returns the splits the files hold."""
    import json

    splits = splits or (make_dataset(n=train_rows, seed=0), make_dataset(n=4, seed=1))
    classes = [str(label) for label in range(splits[0].num_classes)]
    features = {image: {"_type": "Image"}, "label": {"names": classes, "_type": "ClassLabel"}}
    for name, data in zip(("train", "test"), splits):
        images = [{"bytes": encoded(picture), "path": f"{name}/{row}.png"} for row, picture in enumerate(data.images)]
        table = pa.table(
            {image: pa.array(images, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
             "label": pa.array(data.labels.numpy())},
            metadata={"huggingface": json.dumps({"info": {"features": features}})},
        )
        parts = files if name == "train" else 1
        if parts == 1:
            pq.write_table(table, folder / f"{name}.parquet", row_group_size=row_group_size)
            continue
        (folder / f"{name}.parquet").mkdir(parents=True)
        for part, rows in enumerate(np.array_split(np.arange(table.num_rows), parts)):
            path = folder / f"{name}.parquet" / f"{name}-{part:05d}-of-{parts:05d}.parquet"
            pq.write_table(table.slice(rows[0], len(rows)), path, row_group_size=row_group_size)
    return splits


def test_hugging_face_image_parquet_is_read_as_it_is_in_memory_and_streamed(tmp_path):
    """Once refused (the image column a struct), with `--set parquet_columns.image=image.bytes` no way out;
    then refused streamed for want of an id column."""
    train, test = write_hugging_face_splits(tmp_path)
    loaded_train, loaded_test = load_splits("parquet", str(tmp_path))
    assert torch.equal(loaded_train.images, train.images) and torch.equal(loaded_test.images, test.images)
    assert torch.equal(loaded_train.labels, train.labels) and loaded_train.num_classes == 4

    # Streamed as in memory, a row's id is its position in the split.
    streamed_train, streamed_test = inspect_splits(str(tmp_path))
    assert streamed_train.num_classes == 4 and streamed_train.image_shape == (3, 8, 8)
    assert not streamed_train.ids_in_file
    assert torch.equal(streamed_train.sample_ids, torch.arange(12))
    assert torch.equal(streamed_train.sample_ids, loaded_train.sample_ids)
    assert torch.equal(torch.cat([images for images, _ in streamed_test.batches(3)]), test.images)
    np.testing.assert_allclose(streamed_train.mean, loaded_train.mean)


def streamed_rows(split) -> dict[int, tuple[int, torch.Tensor]]:
    """sample_id -> (label, image) of every row Ray Data streams from `split`, as a streamed run's driver
    builds the dataset (raysb.distributed.launch)."""
    from raysb.data.streaming import ray_dataset

    rows = ray_dataset(split).take_all()
    by_id = {int(row["sample_id"]): (int(row["label"]), torch.from_numpy(np.array(row["image"]))) for row in rows}
    assert len(by_id) == len(rows), "no id twice"
    return by_id


def assert_same_rows(streamed: dict[int, tuple[int, torch.Tensor]], in_memory) -> None:
    """The same (sample_id, label, image) triples as the in-memory read."""
    assert sorted(streamed) == in_memory.sample_ids.tolist()
    for row, sample_id in enumerate(in_memory.sample_ids.tolist()):
        label, image = streamed[sample_id]
        assert label == int(in_memory.labels[row]) and torch.equal(image, in_memory.images[row]), f"id {sample_id}"


@pytest.mark.slow
def test_ray_data_streams_hugging_face_parquet_with_the_in_memory_ids(ray_session, tmp_path):
    """Two files of three row groups each (the last one short): each row group's ids start where the rows
    before it in file order end, so streamed and in memory agree example for example. The image column
    named otherwise, as parquet_columns maps it."""
    image = "img"
    columns = {"image": image}
    write_hugging_face_splits(tmp_path, train_rows=22, files=2, row_group_size=4, image=image)
    assert [pq.ParquetFile(path).num_row_groups for path in sorted((tmp_path / "train.parquet").iterdir())] == [3, 3]
    in_memory = load_dataset("parquet", "train", str(tmp_path), parquet_columns=columns)
    split, _ = inspect_splits(str(tmp_path), columns)
    assert torch.equal(split.sample_ids, torch.arange(22))
    assert_same_rows(streamed_rows(split), in_memory)


def write_image_folder(folder: Path) -> None:
    """FOLDER/{train,test}/{cat,dog}/*.png|jpg, as people keep images."""
    for split, per_class in (("train", 4), ("test", 2)):
        for label, name in enumerate(("cat", "dog")):
            (folder / split / name).mkdir(parents=True)
            for row in range(per_class):
                image = torch.full((3, 8, 8), 60 * label + 10 * row, dtype=torch.uint8)
                (folder / split / name / f"{row}.png").write_bytes(encoded(image))
    (folder / "train" / "cat" / "notes.txt").write_text("not an image")


def test_an_image_folder_trains_directly_and_converts_to_parquet(tmp_path, capsys):
    from raysb.cli import main

    write_image_folder(tmp_path / "pets")
    train, test = load_splits("imagefolder", str(tmp_path / "pets"))
    assert train.labels.tolist() == [0] * 4 + [1] * 4 and test.labels.tolist() == [0, 0, 1, 1]
    assert train.num_classes == 2 and train.images[5, 0, 0, 0] == 70

    assert main(["to-parquet", "--from-folder", str(tmp_path / "pets"), "--out", str(tmp_path / "pq")]) == 0
    assert "wrote 2 Parquet file(s)" in capsys.readouterr().out
    converted, _ = load_splits("parquet", str(tmp_path / "pq"))
    assert torch.equal(converted.images, train.images) and torch.equal(converted.labels, train.labels)

    # --dataset parquet on the folder itself names the ImageFolder routes.
    assert main(["train", "--dataset", "parquet", "--data-dir", str(tmp_path / "pets"), "--epochs", "1",
                 "--out", str(tmp_path / "run")]) == 2
    assert ("train with --dataset imagefolder --data-dir FOLDER, or convert it with raysb to-parquet --from-folder "
            "FOLDER --out DIR") in capsys.readouterr().err

    (tmp_path / "pets" / "test" / "bird").mkdir()
    with pytest.raises(ValueError, match="test has class folders that train has not: bird"):
        load_splits("imagefolder", str(tmp_path / "pets"))
    with pytest.raises(DatasetNotFoundError, match="0 class folder.* at least 2 needed; an ImageFolder holds"):
        load_splits("imagefolder", str(tmp_path))
