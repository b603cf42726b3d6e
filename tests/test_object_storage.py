"""--data-dir s3://BUCKET/PREFIX: Parquet read from an S3-compatible server (moto's, on 127.0.0.1),
in memory and streamed, with credentials and endpoint from the environment as pyarrow reads them."""

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from raysb.data import DatasetNotFoundError, ImageDataset, load_splits, write_parquet
from raysb.data.export import export_parquet
from raysb.data.streaming import inspect_splits

BUCKET = "raysb-data"
KEY_ID, SECRET = "raysb-test-key", "raysb-test-secret"


@pytest.fixture(scope="module")
def s3_endpoint():
    """host:port of a moto S3 server holding an empty bucket BUCKET."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    client = boto3.client(
        "s3", endpoint_url=f"http://{host}:{port}", aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=BUCKET)
    yield f"{host}:{port}"
    server.stop()


@pytest.fixture
def aws_environment(s3_endpoint, monkeypatch, tmp_path):
    """The environment a user sets for an S3-compatible store; nothing from this machine's own AWS setup."""
    for name, value in {
        "AWS_ENDPOINT_URL": f"http://{s3_endpoint}",
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)


def upload(endpoint: str, folder: Path, prefix: str) -> None:
    """Every file under `folder` to s3://BUCKET/prefix/..., with boto3 (not raysb)."""
    import boto3

    client = boto3.client(
        "s3", endpoint_url=f"http://{endpoint}", aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        client.upload_fileobj(io.BytesIO(path.read_bytes()), BUCKET, f"{prefix}/{path.relative_to(folder)}")


def dataset(n: int, seed: int, ids: torch.Tensor) -> ImageDataset:
    generator = torch.Generator().manual_seed(seed)
    return ImageDataset(
        images=torch.randint(0, 256, (n, 1, 8, 8), dtype=torch.uint8, generator=generator),
        labels=torch.arange(n) % 4,
        sample_ids=ids,
        num_classes=4,
        mean=(0.5,),
        std=(0.25,),
    )


@pytest.fixture
def local_splits(tmp_path) -> Path:
    """train.parquet as a folder of two files (PNG) and test.parquet as one file (raw uint8), written by raysb."""
    folder = tmp_path / "local"
    train = dataset(40, 0, torch.arange(40) * 3 + 11)
    write_parquet(train.select(torch.arange(20)), folder / "train.parquet" / "part-0.parquet")
    write_parquet(train.select(torch.arange(20, 40)), folder / "train.parquet" / "part-1.parquet")
    write_parquet(dataset(12, 1, torch.arange(12)), folder / "test.parquet", encoding="raw")
    return folder


def test_parquet_from_s3_in_memory_and_inspected_for_streaming(aws_environment, s3_endpoint, local_splits):
    upload(s3_endpoint, local_splits, "runs/fmnist")
    uri = f"s3://{BUCKET}/runs/fmnist"

    remote, local = load_splits("parquet", uri), load_splits("parquet", str(local_splits))
    for got, want in zip(remote, local):
        assert torch.equal(got.images, want.images) and torch.equal(got.sample_ids, want.sample_ids)
        assert got.num_classes == 4 and got.mean == want.mean

    train, test = inspect_splits(uri + "/")  # a trailing slash is the same folder
    assert train.path == f"{uri}/train.parquet" and torch.equal(train.sample_ids, local[0].sample_ids)
    assert torch.equal(torch.cat([images for images, _ in test.batches(5)]), local[1].images)


def test_a_prefix_without_the_split_names_the_uri(aws_environment, s3_endpoint, local_splits):
    upload(s3_endpoint, local_splits / "train.parquet", "only-train/train.parquet")
    not_found = r"parquet {} split not found: nothing at {}\.\nTo fix: pass --data-dir"
    with pytest.raises(DatasetNotFoundError, match=not_found.format("test", f"s3://{BUCKET}/only-train/test.parquet")):
        load_splits("parquet", f"s3://{BUCKET}/only-train")
    with pytest.raises(DatasetNotFoundError, match=not_found.format("train", "s3://no-such-bucket/x/train.parquet")):
        inspect_splits("s3://no-such-bucket/x")
    with pytest.raises(DatasetNotFoundError, match=r"cannot read nfs://host/x/train.parquet: Unrecognized filesystem"):
        inspect_splits("nfs://host/x")
    with pytest.raises(ValueError, match=r"data_dir s3://raysb-data/x: mnist is read from local files"):
        load_splits("mnist", f"s3://{BUCKET}/x")


def test_to_parquet_writes_to_s3(aws_environment, local_splits):
    uri = f"s3://{BUCKET}/exported"
    written = export_parquet("parquet", uri, data_dir=str(local_splits), files=2)
    assert written[0] == f"{uri}/train.parquet/part-0000.parquet" and len(written) == 4
    train, _ = inspect_splits(uri)
    assert torch.equal(train.sample_ids, torch.arange(40) * 3 + 11)


@pytest.mark.slow
def test_ray_data_streams_s3(ray_session, s3_endpoint, local_splits):
    """Ray Data's read tasks, as a streamed run's driver builds them (raysb.distributed.launch).

    Ray's worker processes keep the environment the test session's Ray started with, so here the
    endpoint and keys travel in the URI, a form pyarrow takes (s3://KEY:SECRET@BUCKET/PREFIX?...).
    """
    from raysb.data.streaming import ray_dataset

    upload(s3_endpoint, local_splits, "streamed")
    uri = f"s3://{KEY_ID}:{SECRET}@{BUCKET}/streamed?endpoint_override={s3_endpoint}&scheme=http&region=us-east-1"
    split, _ = inspect_splits(uri)
    rows = {int(row["sample_id"]): row for row in ray_dataset(split).take_all()}
    local = load_splits("parquet", str(local_splits))[0]
    assert sorted(rows) == local.sample_ids.tolist()
    first = rows[int(local.sample_ids[0])]
    assert torch.equal(torch.from_numpy(np.array(first["image"])), local.images[0]) and int(first["label"]) == 0


def test_hugging_face_image_parquet_from_s3(aws_environment, s3_endpoint, tmp_path):
    from test_data import write_hugging_face_splits

    folder = tmp_path / "hf"
    folder.mkdir()
    train, test = write_hugging_face_splits(folder)
    upload(s3_endpoint, folder, "hf")
    remote_train, remote_test = load_splits("parquet", f"s3://{BUCKET}/hf")
    assert torch.equal(remote_train.images, train.images) and torch.equal(remote_test.labels, test.labels)


@pytest.mark.slow
def test_ray_data_streams_hugging_face_parquet_from_s3(ray_session, s3_endpoint, tmp_path):
    """No id column: Ray Data's read tasks reopen each row group through the URI's filesystem (keys and
    endpoint in the URI, as in test_ray_data_streams_s3) and give its rows their positions as ids."""
    from test_data import assert_same_rows, streamed_rows, write_hugging_face_splits

    folder = tmp_path / "hf"
    write_hugging_face_splits(folder, train_rows=22, files=2, row_group_size=4)
    upload(s3_endpoint, folder, "hf-streamed")
    uri = f"s3://{KEY_ID}:{SECRET}@{BUCKET}/hf-streamed?endpoint_override={s3_endpoint}&scheme=http&region=us-east-1"
    split, _ = inspect_splits(uri)
    assert torch.equal(split.sample_ids, torch.arange(22))
    assert_same_rows(streamed_rows(split), load_splits("parquet", str(folder))[0])


def test_to_parquet_into_a_missing_bucket_is_one_line(aws_environment, local_splits, capsys):
    """It once ended in `OSError: ... NO_SUCH_BUCKET`."""
    from raysb.cli import main

    out = "s3://missing-bucket/exported"
    assert main(["to-parquet", "--dataset", "parquet", "--data-dir", str(local_splits), "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"raysb: error: --out {out}: cannot write {out}/train.parquet: ") and err.count("\n") == 1
    assert "NoSuchBucket" in err or "NO_SUCH_BUCKET" in err
