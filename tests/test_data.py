"""Tests of the input pipeline: the offline digits dataset, process sharding, pad+mask."""

import doctest
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds
from sklearn.datasets import load_digits

import experiments.datasets  # noqa: F401  (registers the "digits" builder)
from experiments.datasets import digits
from replicator import data


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
    num_processes, shard_size = 3, 360 // 3
    epochs = {}  # process -> [indices of its first epoch, of its second]
    for process in range(num_processes):
        # One local batch is exactly one epoch of this process's shard.
        batches = _train_batches(
            _WithIndex(test_source),
            2,
            global_batch_size=num_processes * shard_size,
            seed=0,
            process_index=process,
            process_count=num_processes,
        )
        epochs[process] = [b["index"] for b in batches]
    first_epoch = np.concatenate([e[0] for e in epochs.values()])
    np.testing.assert_array_equal(np.sort(first_epoch), np.arange(360))
    for first, second in epochs.values():
        np.testing.assert_array_equal(np.sort(first), np.sort(second))
        assert not np.array_equal(first, second), "each epoch must be reshuffled"
        assert not np.array_equal(first, np.sort(first)), "examples must be shuffled"


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
    state = it.get_state()
    expected = [next(it) for _ in range(3)]

    restored = data.make_train_iterator(source, **kwargs)
    restored.set_state(state)
    _assert_same_batches([next(restored) for _ in range(3)], expected)


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
    assert time.monotonic() - start < 10, "must not try to download"
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


@pytest.mark.parametrize("module", [data, digits])
def test_docstring_examples_run(module, data_dir):
    result = doctest.testmod(
        module, extraglobs={"data_dir": data_dir}, optionflags=doctest.ELLIPSIS
    )
    assert result.attempted > 0 and result.failed == 0
