"""Tests of the input pipeline: the offline digits dataset, process sharding, pad+mask."""

import io
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds
from sklearn.datasets import load_digits

import experiments.datasets  # noqa: F401  (registers the "digits" builder)
from experiments.datasets import digits
from experiments.datasets.base import LocalBuilder
from replicator.trainer import data


@pytest.fixture(scope="module")
def data_dir(digits_data_dir: str) -> str:
    return digits_data_dir


@pytest.fixture(scope="module")
def train_source(data_dir: str):
    return data.load_data_source("digits", "train", data_dir=data_dir)


@pytest.fixture(scope="module")
def test_source(data_dir: str):
    return data.load_data_source("digits", "test", data_dir=data_dir)


class _WithIndex:
    """A data source whose examples also carry their own position, to see who read what."""

    def __init__(self, source):
        self._source = source

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> dict:
        return {**self._source[index], "index": np.int64(index)}

    def __repr__(self) -> str:
        return f"_WithIndex({self._source!r})"


def _preprocess(example: dict) -> dict:
    return {**example, "image": example["image"].astype(np.float32) / 255.0}


def _read_all(source) -> tuple[np.ndarray, np.ndarray]:
    examples = [source[i] for i in range(len(source))]
    return np.stack([e["image"] for e in examples]), np.array([e["label"] for e in examples])


def _train_batches(source, num_batches: int, **kwargs) -> list[dict]:
    it = data.make_train_iterator(source, preprocess=_preprocess, **kwargs)
    return [next(it) for _ in range(num_batches)]


def _assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for batch_a, batch_b in zip(a, b, strict=True):
        assert batch_a.keys() == batch_b.keys()
        for key in batch_a:
            np.testing.assert_array_equal(batch_a[key], batch_b[key])


# The digits dataset.


def test_digits_splits_have_fixed_sizes(data_dir, train_source, test_source):
    assert (len(train_source), len(test_source)) == (1437, 360)
    splits = tfds.builder("digits", data_dir=data_dir).info.splits
    assert sum(split.num_examples for split in splits.values()) == 1797


def test_digits_examples_are_uint8_images_with_labels(train_source, test_source):
    for source in (train_source, test_source):
        images, labels = _read_all(source)
        assert images.dtype == np.uint8 and images.shape[1:] == (8, 8, 1)
        assert images.max() == 255
        assert set(labels.tolist()) == set(range(10))


def test_digits_splits_together_hold_every_sklearn_digit_once(train_source, test_source):
    sklearn_digits = load_digits()
    expected = np.concatenate(
        [np.rint(sklearn_digits.images.reshape(-1, 64) * 255 / 16), sklearn_digits.target[:, None]],
        axis=1,
    )
    rows = []
    for source in (train_source, test_source):
        images, labels = _read_all(source)
        rows.append(np.concatenate([images.reshape(-1, 64), labels[:, None]], axis=1))
    got = np.concatenate(rows).astype(np.float64)
    # Same multiset of rows (pixels, label): compare both in lexicographic order.
    np.testing.assert_array_equal(got[np.lexsort(got.T)], expected[np.lexsort(expected.T)])


def test_split_test_mask_is_stratified_and_exact():
    labels = load_digits().target
    is_test = digits.split_test_mask(labels, 360, seed=0)
    assert is_test.sum() == 360
    share = np.bincount(labels[is_test], minlength=10) / np.bincount(labels)
    np.testing.assert_allclose(share, 360 / len(labels), atol=0.01)
    np.testing.assert_array_equal(is_test, digits.split_test_mask(labels, 360, seed=0))


# Training iterator.


def test_train_shards_are_disjoint_cover_the_split_and_reshuffle(test_source):
    num_processes = 3
    # One global batch is exactly one epoch of the split.
    per_process = {
        process: [
            b["index"]
            for b in _train_batches(
                _WithIndex(test_source),
                2,
                global_batch_size=360,
                seed=0,
                process_index=process,
                process_count=num_processes,
            )
        ]
        for process in range(num_processes)
    }
    single = [
        b["index"]
        for b in _train_batches(
            _WithIndex(test_source),
            2,
            global_batch_size=360,
            seed=0,
            process_index=0,
            process_count=1,
        )
    ]
    for epoch in range(2):
        rows = np.concatenate([per_process[p][epoch] for p in range(num_processes)])
        np.testing.assert_array_equal(np.sort(rows), np.arange(360))  # disjoint, covering
        np.testing.assert_array_equal(rows, single[epoch])  # the same global batch as 1 process
    assert not np.array_equal(single[0], single[1]), "each epoch must be reshuffled"
    assert not np.array_equal(single[0], np.sort(single[0])), "examples must be shuffled"


def test_train_batches_are_process_local_and_preprocessed(train_source):
    (batch,) = _train_batches(
        train_source, 1, global_batch_size=48, seed=0, process_index=1, process_count=3
    )
    assert batch["image"].shape == (16, 8, 8, 1) and batch["image"].dtype == np.float32
    assert batch["label"].shape == (16,)
    assert 0.0 <= batch["image"].min() and batch["image"].max() <= 1.0


def test_train_order_depends_only_on_the_seed(train_source):
    kwargs = dict(global_batch_size=32, process_index=0, process_count=2)
    first = _train_batches(train_source, 3, seed=7, **kwargs)
    _assert_same_batches(first, _train_batches(train_source, 3, seed=7, **kwargs))
    other = _train_batches(train_source, 3, seed=8, **kwargs)
    assert not np.array_equal(first[0]["image"], other[0]["image"])


def test_train_iterator_resumes_from_saved_state(data_dir):
    # A 100-example slice: shards of 50, batches of 16 per process, so the
    # three batches after the saved state run across an epoch boundary.
    source = _WithIndex(data.load_data_source("digits", "train[:100]", data_dir=data_dir))
    kwargs = dict(
        global_batch_size=32, preprocess=_preprocess, seed=3, process_index=1, process_count=2
    )
    it = data.make_train_iterator(source, **kwargs)
    next(it), next(it)
    # As the trainer stores it in a checkpoint: a string.
    saved = it.get_state().decode()
    expected = [next(it) for _ in range(3)]

    restored = data.make_train_iterator(source, **kwargs)
    restored.set_state(saved.encode())
    _assert_same_batches([next(restored) for _ in range(3)], expected)


def test_restoring_the_state_of_another_stream_is_an_error():
    source = [{"x": np.float32(i)} for i in range(10)]
    kwargs = dict(global_batch_size=4, preprocess=dict, process_index=0, process_count=2)
    state = data.make_train_iterator(source, seed=3, **kwargs).get_state()
    with pytest.raises(ValueError, match="'seed': 3.*'seed': 4"):
        data.make_train_iterator(source, seed=4, **kwargs).set_state(state)


@pytest.mark.parametrize("global_batch_size", [4, 14])  # smaller and larger than the split
def test_every_epoch_is_a_permutation_of_the_split(global_batch_size):
    source = _WithIndex([{"x": np.float32(i)} for i in range(10)])
    iterators = [
        data.make_train_iterator(
            source,
            global_batch_size=global_batch_size,
            preprocess=dict,
            seed=0,
            process_index=p,
            process_count=2,
        )
        for p in range(2)
    ]
    # The global stream: each global batch is process 0's rows, then process 1's.
    stream = np.concatenate(
        [np.concatenate([next(it)["index"] for it in iterators]) for _ in range(10)]
    )
    epochs = stream[: len(stream) // 10 * 10].reshape(-1, 10)
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(10))
    assert len({tuple(epoch) for epoch in epochs}) > 1, "each epoch must be reshuffled"


def test_train_batches_do_not_depend_on_threads(train_source):
    kwargs = dict(global_batch_size=48, seed=5, process_index=0, process_count=1)
    sequential = _train_batches(train_source, 40, **kwargs)
    threaded = _train_batches(train_source, 40, num_threads=3, **kwargs)
    _assert_same_batches(sequential, threaded)


# Reading batches and the in-memory cache.


class _CountingSource:
    """A list-backed source that counts the examples read from it."""

    def __init__(self, examples: list[dict]):
        self.examples, self.reads = examples, 0

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        self.reads += 1
        return self.examples[index]


def test_small_splits_are_cached_unless_disabled(data_dir):
    assert isinstance(data.load_data_source("digits", "test", data_dir=data_dir), data.CachedSource)
    uncached = data.load_data_source("digits", "test", data_dir=data_dir, max_cache_bytes=0)
    assert not isinstance(uncached, data.CachedSource)


def test_cached_source_reads_each_example_once(test_source):
    examples = [test_source[i] for i in range(20)]
    counting = _CountingSource(examples)
    cached = data.CachedSource(counting)
    for indices in ([3, 1, 3], [1, 2, 19, 0], list(range(20)), [7]):
        batch = cached.read_batch(indices)
        np.testing.assert_array_equal(
            batch["image"], np.stack([examples[i]["image"] for i in indices])
        )
        np.testing.assert_array_equal(batch["label"], [examples[i]["label"] for i in indices])
    assert counting.reads == 20
    np.testing.assert_array_equal(cached[-1]["image"], examples[19]["image"])


def test_cached_batches_are_copies_that_preprocessing_may_change():
    cached = data.CachedSource([{"x": np.zeros(2)}, {"x": np.ones(2)}])
    cached.read_batch([0, 1])["x"] *= 7  # In place, as a careless preprocess might.
    np.testing.assert_array_equal(cached.read_batch([0, 1])["x"], [[0, 0], [1, 1]])


def test_examples_of_different_shapes_are_a_clear_error():
    examples = [{"x": np.zeros(2)}, {"x": np.zeros(3)}]
    with pytest.raises(ValueError, match="one shape across the split"):
        data.read_batch(examples, [0, 1])
    cached = data.CachedSource(examples)
    cached.read_batch([0])
    with pytest.raises(ValueError, match="one shape across the split"):
        cached.read_batch([1])


class PicturesForTests(LocalBuilder):
    """A tiny offline dataset with the feature kinds of tfds' image datasets."""

    def _info(self):
        features = tfds.features.FeaturesDict(
            {
                "image": tfds.features.Image(shape=(12, 10, 3)),  # PNG
                "gray": tfds.features.Image(shape=(6, 5, 1)),
                "label": tfds.features.ClassLabel(num_classes=4),
                "weights": tfds.features.Tensor(shape=(2, 3), dtype=np.float32),
                "flag": tfds.features.Scalar(dtype=np.bool_),
                "score": tfds.features.Scalar(dtype=np.float32),
                "small": tfds.features.Scalar(dtype=np.uint8),
                "pixels": tfds.features.Tensor(shape=(2, 2), dtype=np.uint8),
                "raw": tfds.features.Tensor(shape=(4,), dtype=np.int16, encoding="bytes"),
                "name": tfds.features.Text(),
            }
        )
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
        del dl_manager
        return {"train": self._generate_examples(37)}

    def _generate_examples(self, n):
        from PIL import Image

        rng = np.random.default_rng(0)
        for i in range(n):
            images = []
            for shape in ((12, 10, 3), (6, 5)):
                png = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(png, "png")
                images.append(png.getvalue())  # bytes: tfds would encode arrays with TF
            yield (
                i,
                {
                    "image": images[0],
                    "gray": images[1],
                    "label": i % 4,
                    "weights": rng.normal(size=(2, 3)).astype(np.float32),
                    "flag": bool(i % 3),
                    "score": np.float32(i / 7),
                    "small": np.uint8(i),
                    "pixels": rng.integers(0, 256, (2, 2)).astype(np.uint8),
                    "raw": rng.integers(-500, 500, 4).astype(np.int16),
                    "name": f"example {i}",
                },
            )


def test_batch_decoding_equals_tfds_example_by_example(tmp_path):
    tfds.builder("pictures_for_tests", data_dir=str(tmp_path)).download_and_prepare(
        file_format="array_record"
    )
    source = data.load_data_source(
        "pictures_for_tests", "train", data_dir=str(tmp_path), max_cache_bytes=0
    )
    assert isinstance(source, data.RecordSource)
    indices = [5, 0, 36, 5, 17]
    batch = data.read_batch(source, indices)
    # tfds' own decoder, one example at a time.
    reference = tfds.builder("pictures_for_tests", data_dir=str(tmp_path)).as_data_source("train")
    examples = [reference[i] for i in indices]
    assert sorted(batch) == sorted(examples[0])
    for key, column in batch.items():
        want = np.stack([e[key] for e in examples])
        assert column.shape == want.shape, key
        if key != "name":
            assert column.dtype == want.dtype, key
        np.testing.assert_array_equal(column, want, err_msg=key)


class RaggedForTests(LocalBuilder):
    """Features that RecordSource leaves to tfds: a nested dict and a ragged tensor."""

    def _info(self):
        features = tfds.features.FeaturesDict(
            {
                "values": tfds.features.Tensor(shape=(None,), dtype=np.int64),
                "meta": tfds.features.FeaturesDict({"id": tfds.features.Scalar(np.int64)}),
            }
        )
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
        del dl_manager
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for i in range(5):
            yield i, {"values": np.full(3, i, np.int64), "meta": {"id": i}}


def test_nested_and_ragged_features_keep_tfds_decoding(tmp_path):
    tfds.builder("ragged_for_tests", data_dir=str(tmp_path)).download_and_prepare(
        file_format="array_record"
    )
    source = data.load_data_source(
        "ragged_for_tests", "train", data_dir=str(tmp_path), max_cache_bytes=0
    )
    assert not isinstance(source, data.RecordSource)
    batch = data.read_batch(source, [4, 1])
    ids = [source[4]["meta"]["id"], source[1]["meta"]["id"]]  # tfds shuffles on writing
    np.testing.assert_array_equal(batch["meta"]["id"], ids)
    np.testing.assert_array_equal(batch["values"], np.repeat(np.array(ids)[:, None], 3, 1))


def test_digits_decode_a_batch_at_a_time(data_dir):
    records = data.load_data_source("digits", "train", data_dir=data_dir, max_cache_bytes=0)
    assert isinstance(records, data.RecordSource)
    indices = np.random.default_rng(1).permutation(len(records))[:100]
    batch = data.read_batch(records, indices)
    for key in ("image", "label"):
        want = np.stack([records[i][key] for i in indices])
        np.testing.assert_array_equal(batch[key], want)
        assert batch[key].dtype == want.dtype


def test_background_filling_decodes_each_example_once(test_source):
    examples = [test_source[i] for i in range(50)]
    counting = _CountingSource(examples)
    cached = data.CachedSource(counting)
    cached.fill_in_background(chunk_size=8)
    batch = cached.read_batch(list(range(49, -1, -1)))  # races the filler on purpose
    cached.stop_filling()
    np.testing.assert_array_equal(batch["image"][::-1], np.stack([e["image"] for e in examples]))
    assert counting.reads == 50  # The reader waits for the chunk the filler is decoding.
    reads = counting.reads
    cached.read_batch(list(range(50)))
    assert counting.reads == reads


class _BrokenSource(_CountingSource):
    def __getitem__(self, index: int) -> dict:
        if index == 5:
            raise ValueError("example 5 is corrupt")
        return super().__getitem__(index)


def test_a_failing_background_decode_reaches_the_reader_instead_of_hanging_it(test_source):
    cached = data.CachedSource(_BrokenSource([test_source[i] for i in range(20)]))
    cached.fill_in_background(chunk_size=8)
    with pytest.raises(ValueError, match="example 5 is corrupt"):
        cached.read_batch(list(range(20)))
    cached.stop_filling()
    assert cached.read_batch([12, 19])["image"].shape[0] == 2


# Evaluation iterator.


@pytest.mark.parametrize("num_processes", [1, 2, 3])
def test_eval_counts_every_example_exactly_once(test_source, num_processes):
    global_batch_size = 48  # 360 examples do not fill a whole number of batches.
    source = _WithIndex(test_source)
    expected_batches = data.num_eval_batches(
        len(source), global_batch_size=global_batch_size, process_count=num_processes
    )
    seen, num_batches = [], []
    for process in range(num_processes):
        batches = list(
            data.make_eval_iterator(
                source,
                global_batch_size=global_batch_size,
                preprocess=_preprocess,
                process_index=process,
                process_count=num_processes,
            )
        )
        num_batches.append(len(batches))
        for batch in batches:
            assert batch["mask"].dtype == bool
            assert batch["image"].shape == (global_batch_size // num_processes, 8, 8, 1)
            seen.append(batch["index"][batch["mask"]])
    assert num_batches == [expected_batches] * num_processes
    seen = np.concatenate(seen)
    assert len(seen) == 360
    np.testing.assert_array_equal(np.sort(seen), np.arange(360))


def _eval_masks(source, global_batch_size: int, num_processes: int) -> list[list[list[bool]]]:
    return [
        [
            batch["mask"].tolist()
            for batch in data.make_eval_iterator(
                source,
                global_batch_size=global_batch_size,
                preprocess=dict,
                process_index=process,
                process_count=num_processes,
            )
        ]
        for process in range(num_processes)
    ]


def test_eval_pads_processes_that_run_out_with_fully_masked_batches():
    source = [{"x": np.float32(i)} for i in range(5)]  # Shards of 1, 2 and 2 examples.
    assert _eval_masks(source, 6, 3) == [[[True, False]], [[True, True]], [[True, True]]]
    assert _eval_masks(source, 3, 3) == [[[True], [False]], [[True], [True]], [[True], [True]]]


# Errors.


def test_batch_that_does_not_split_over_processes_is_an_error(train_source):
    with pytest.raises(ValueError, match=r"global_batch_size=10 .*process_count=3"):
        data.make_train_iterator(
            train_source,
            global_batch_size=10,
            preprocess=_preprocess,
            seed=0,
            process_index=0,
            process_count=3,
        )
    with pytest.raises(ValueError, match=r"global_batch_size=10 .*process_count=4"):
        data.make_eval_iterator(
            train_source,
            global_batch_size=10,
            preprocess=_preprocess,
            process_index=0,
            process_count=4,
        )


def test_unknown_dataset_is_an_error_with_close_matches(data_dir):
    with pytest.raises(ValueError, match=r"Unknown dataset 'digitz'.*'digits'"):
        data.load_data_source("digitz", "train", data_dir=data_dir)


def test_unknown_split_is_an_error_naming_the_splits(data_dir):
    with pytest.raises(ValueError, match=r"'validation'.*\['test', 'train'\]"):
        data.load_data_source("digits", "validation", data_dir=data_dir)


def test_download_based_dataset_that_is_missing_fails_fast(tmp_path):
    start = time.monotonic()
    with pytest.raises(data.DatasetNotPreparedError) as error:
        data.load_data_source("mnist", "train", data_dir=str(tmp_path))
    assert time.monotonic() - start < 30, "must not try to download"  # loaded 2 cores: ~5 s
    message = str(error.value)
    assert str(tmp_path) in message
    assert "tfds build mnist --data_dir=DIR --file_format=array_record" in message


def test_offline_dataset_is_not_built_when_prepare_is_false(tmp_path):
    with pytest.raises(data.DatasetNotPreparedError, match="prepare=True"):
        data.load_data_source("digits", "train", data_dir=str(tmp_path), prepare=False)


def test_mock_data_stands_in_for_download_based_datasets(tmp_path):
    with tfds.testing.mock_data(num_examples=6):
        source = data.load_data_source("mnist", "train", data_dir=str(tmp_path))
        assert len(source) == 6 and source[0]["image"].shape == (28, 28, 1)


# Doctests of the public functions.
