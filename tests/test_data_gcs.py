"""A tfds data_dir in a bucket (a real local GCS server, tests/gcs.py): prepared there,
read back through each machine's local copy, equal to the same data on a local disk."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import experiments.datasets  # noqa: F401  (registers the "digits" builder)
from replicator import storage
from replicator.trainer import data
from replicator.trainer.data import remote, sources
from tests import gcs
from tests.helpers.configs import read_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS_FILES = [
    "digits/1.0.0/dataset_info.json",
    "digits/1.0.0/digits-test.array_record-00000-of-00001",
    "digits/1.0.0/digits-train.array_record-00000-of-00001",
    "digits/1.0.0/features.json",
]


@pytest.fixture
def prepared(bucket, tmp_path) -> str:
    """A bucket data_dir with digits prepared in it (built under a cache of its own)."""
    data_dir = f"{bucket}/tfds"
    version_url = data.prepare_dataset("digits", data_dir, cache_dir=tmp_path / "builder")
    assert version_url == f"{data_dir}/digits/1.0.0"
    return data_dir


def all_examples(source) -> dict:
    return data.read_batch(source, np.arange(len(source)))


def copy_of(data_dir: str, cache_dir) -> str:
    return remote.local_path(f"{data_dir}/digits/1.0.0", cache_dir)


def test_digits_prepared_in_a_bucket_read_back_equal_the_local_ones(
    prepared, digits_data_dir, tmp_path
):
    assert gcs.list_objects(prepared) == DIGITS_FILES  # no marker, no tfds leftovers
    cache = tmp_path / "cache"
    for split in ("train", "test"):
        read = data.load_data_source("digits", split, data_dir=prepared, cache_dir=cache)
        local = data.load_data_source("digits", split, data_dir=digits_data_dir)
        assert len(read) == len(local) > 0
        got, want = all_examples(read), all_examples(local)
        for key in ("image", "label"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{split} {key}")
    # Only the dataset's version was copied, where the docs say.
    copy = copy_of(prepared, cache)
    assert copy == os.path.join(str(cache), prepared.removeprefix("gs://"), "digits", "1.0.0")
    assert sorted(os.listdir(copy)) == sorted(
        [remote.COMPLETE_MARKER, *(f.rsplit("/", 1)[1] for f in DIGITS_FILES)]
    )


def test_a_second_open_reuses_the_copy_even_from_another_process(prepared, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    script = (
        "import sys, experiments.datasets\n"
        "from replicator.trainer import data\n"
        "print(len(data.load_data_source('digits', 'test', data_dir=sys.argv[1], "
        "cache_dir=sys.argv[2])))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, prepared, str(cache)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.split()[-1] == "360", done.stderr[-3000:]
    copy = copy_of(prepared, cache)
    stamps = {name: os.stat(os.path.join(copy, name)).st_mtime_ns for name in os.listdir(copy)}

    def no_download(*args):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(remote, "download", no_download)
    for split in ("train", "test", "train"):
        assert len(data.load_data_source("digits", split, data_dir=prepared, cache_dir=cache))
    assert {name: os.stat(os.path.join(copy, name)).st_mtime_ns for name in stamps} == stamps


def test_a_copy_cut_short_is_made_again(prepared, digits_data_dir, tmp_path):
    cache = tmp_path / "cache"
    copy = copy_of(prepared, cache)
    # What a kill halfway through leaves: metadata, half a shard, no marker.
    os.makedirs(copy)
    for name in ("dataset_info.json", "features.json"):
        with open(os.path.join(copy, name), "wb") as f:
            f.write(storage.read_bytes(f"{prepared}/digits/1.0.0/{name}"))
    shard = "digits-train.array_record-00000-of-00001"
    whole = storage.read_bytes(f"{prepared}/digits/1.0.0/{shard}")
    with open(os.path.join(copy, shard), "wb") as f:
        f.write(whole[: len(whole) // 2])

    read = data.load_data_source("digits", "train", data_dir=prepared, cache_dir=cache)
    assert remote.is_complete(copy)
    with open(os.path.join(copy, shard), "rb") as f:
        assert f.read() == whole
    local = data.load_data_source("digits", "train", data_dir=digits_data_dir)
    np.testing.assert_array_equal(all_examples(read)["image"], all_examples(local)["image"])


def test_a_missing_offline_dataset_is_built_and_uploaded_by_process_0_only(
    bucket, tmp_path, monkeypatch
):
    data_dir = f"{bucket}/tfds"
    monkeypatch.setattr(sources, "_is_first_process", lambda: False)
    source = data.load_data_source("digits", "test", data_dir=data_dir, cache_dir=tmp_path / "a")
    assert len(source) == 360 and gcs.list_objects(bucket) == []  # read from its own build
    monkeypatch.setattr(sources, "_is_first_process", lambda: True)
    data.load_data_source("digits", "test", data_dir=data_dir, cache_dir=tmp_path / "a")
    assert gcs.list_objects(data_dir) == DIGITS_FILES  # uploaded from the copy it had


def test_a_missing_bucket_is_one_storage_error_at_once(gcs_server, tmp_path):
    data_dir = "gs://no-such-bucket-for-data/tfds"
    for call in (
        lambda: data.load_data_source("digits", "train", data_dir=data_dir, cache_dir=tmp_path),
        lambda: data.prepare_dataset("digits", data_dir, cache_dir=tmp_path),
    ):
        start = time.monotonic()
        with pytest.raises(storage.StorageError) as error:
            call()
        assert time.monotonic() - start < 10
        message = str(error.value)
        assert "\n" not in message and "no such bucket gs://no-such-bucket-for-data" in message
    assert not os.listdir(tmp_path)  # nothing built for a bucket that is not there


def test_a_download_based_dataset_missing_from_the_bucket_says_how_to_copy_it_in(bucket, tmp_path):
    data_dir = f"{bucket}/tfds"
    for call in (
        lambda: data.load_data_source("mnist", "train", data_dir=data_dir, cache_dir=tmp_path),
        lambda: data.prepare_dataset("mnist", data_dir, cache_dir=tmp_path),
    ):
        with pytest.raises(data.DatasetNotPreparedError) as error:
            call()
        message = str(error.value)
        assert f"{data_dir}/mnist/3.0.1" in message
        assert "tfds build mnist --data_dir=DIR --file_format=array_record" in message
        assert f"gcloud storage cp -r DIR/mnist {data_dir}/" in message
    assert gcs.list_objects(bucket) == []


def test_an_offline_dataset_is_not_built_into_a_bucket_when_prepare_is_false(bucket, tmp_path):
    with pytest.raises(data.DatasetNotPreparedError, match="prepare_dataset"):
        data.load_data_source(
            "digits", "train", data_dir=f"{bucket}/tfds", cache_dir=tmp_path, prepare=False
        )
    assert gcs.list_objects(bucket) == []


def test_train_reads_its_data_from_the_bucket(bucket, tmp_path):
    """The command line, on an empty bucket: digits is built, uploaded, and trained on."""
    data_dir, workdir = f"{bucket}/tfds", str(tmp_path / "run")
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        XDG_CACHE_HOME=str(tmp_path / "cache"),
    )
    done = subprocess.run(
        [sys.executable, "-m", "replicator", "train", "--config", "configs/digits_cnn.py:smoke",
         "--workdir", workdir, f"--config.data_dir={data_dir}", "--config.num_train_steps=5",
         "--quiet"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert gcs.list_objects(data_dir) == DIGITS_FILES
    copy = remote.local_path(f"{data_dir}/digits/1.0.0", tmp_path / "cache/replicator/tfds")
    with open(os.path.join(copy, remote.COMPLETE_MARKER)) as f:
        assert json.load(f)["source"] == f"{data_dir}/digits/1.0.0"
    records = read_records(workdir)
    assert max(r["step"] for r in records if "loss" in r) == 5
    evals = [r for r in records if r.get("split") == "test"]
    assert evals and all(r["num_examples"] == 360 for r in evals)
