"""Data of one's own without a tfds builder: a data function (``'module:function'``),
array_record files (``'array_record:PATTERN'``), a tfds builder of one's own with no
flag, and code beside a config file outside the repository (examples/regression)."""

import importlib.util
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from replicator import storage, trainer
from replicator.errors import ConfigError, DatasetError, UserError
from replicator.trainer import data
from replicator.trainer.data import array_records, remote, user_sources
from tests.helpers.cli import assert_one_line_error, run_cli
from tests.helpers.configs import digits_config, read_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "regression")
DIGITS_FUNCTION = "experiments.datasets.digits:make_source"

BAD_DATA = """
import numpy as np

def make_source(split):
    return [{"x": np.float32(i)} for i in range(10)]

def raises(split):
    raise RuntimeError(f"no {split} here")

def generator(split):
    return ({"x": np.float32(i)} for i in range(10))

def tuples(split):
    return [(np.float32(i), np.int64(i)) for i in range(10)]

def ragged(split):
    return [{"x": np.zeros(1 + i // 5, np.float32)} for i in range(10)]

def empty(split):
    return []

def lists(split):
    return [{"x": [1.0, 2.0]} for _ in range(10)]

NOT_A_FUNCTION = 3
"""

# Each mistake in a data function, and the words its one line has.
BAD_INPUTS = [
    ("no_such_module:make_source", "no module named 'no_such_module'"),
    ("bad_data:nope", "has no 'nope'; its functions and classes: empty, generator"),
    ("bad_data:NOT_A_FUNCTION", "is not a function of the split's name"),
    ("bad_data:raises", "raises('test') raised RuntimeError: no test here"),
    ("bad_data:generator", "returned a generator, which has no __len__ or __getitem__"),
    ("bad_data:tuples", "item 0 is a tuple, not a dict of numpy arrays"),
    ("bad_data:ragged", "items 0 and 5 differ: 'x' is float32[1] in item 0 and float32[2]"),
    ("bad_data:empty", "split 'test' is empty"),
    ("bad_data:lists", "'x' is a list; values are numpy arrays"),
    ("array_record:/nowhere/{split}-*.array_record", "no array_record file matches"),
    ("array_record:/nowhere/test.array_record", "needs '{split}' where the split's name goes"),
]


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> str:
    """examples/regression copied outside the repository, with a module of bad data
    functions beside its config."""
    directory = tmp_path_factory.mktemp("outside") / "regression"
    shutil.copytree(EXAMPLE, directory, ignore=shutil.ignore_patterns("__pycache__"))
    (directory / "bad_data.py").write_text(BAD_DATA)
    return str(directory)


@pytest.fixture
def example_importable(monkeypatch, outside):
    """What ``python -m replicator`` does for a config file: its directory on sys.path."""
    monkeypatch.syspath_prepend(outside)


def regression_config(directory: str, **overrides):
    spec = importlib.util.spec_from_file_location("config", os.path.join(directory, "config.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("smoke")
    config.update(overrides)
    return config


def all_rows(source) -> dict:
    return data.read_batch(source, np.arange(len(source)))


def assert_same_rows(a, b) -> None:
    rows_a, rows_b = all_rows(a), all_rows(b)
    assert rows_a.keys() == rows_b.keys()
    for key in rows_a:
        np.testing.assert_array_equal(rows_a[key], rows_b[key], err_msg=key)
        assert rows_a[key].dtype == rows_b[key].dtype, key


def train_records(workdir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_records(workdir) if "split" not in r]


# ---- A data function


def test_the_digits_function_gives_the_tfds_digits_rows_in_their_order(digits_data_dir):
    for split in ("train", "test", "train[:10%]+test[-5:]"):
        own = data.load_data_source(DIGITS_FUNCTION, split)
        built = data.load_data_source("digits", split, data_dir=digits_data_dir)
        assert len(own) == len(built) > 0
        assert_same_rows(own, built)


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory, digits_data_dir):
    """The digits smoke config for 6 steps: on tfds' digits, on the data function, and on
    the data function stopped after step 2 and resumed."""
    root = tmp_path_factory.mktemp("digits_runs")
    steps = dict(num_train_steps=6, eval_every_steps=2, checkpoint_every_steps=2)
    tfds_config = digits_config(data_dir=digits_data_dir, **steps)
    function_config = digits_config(dataset=DIGITS_FUNCTION, **steps)
    results = {
        "tfds": trainer.train_and_evaluate(tfds_config, str(root / "tfds"), quiet=True),
        "function": trainer.train_and_evaluate(function_config, str(root / "function"), quiet=True),
    }
    first_part = digits_config(dataset=DIGITS_FUNCTION, **{**steps, "num_train_steps": 2})
    trainer.train_and_evaluate(first_part, str(root / "resumed"), quiet=True)
    results["resumed"] = trainer.train_and_evaluate(
        function_config, str(root / "resumed"), quiet=True
    )
    return root, results


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_a_data_function_of_the_digits_trains_like_the_tfds_digits(digits_runs):
    root, results = digits_runs
    assert results["function"]["num_examples"] == 360
    assert results["function"] == results["tfds"]  # the same batches: the same numbers
    assert train_records(root / "function") == train_records(root / "tfds")


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_resuming_a_run_on_a_data_function_equals_never_stopping(digits_runs):
    root, results = digits_runs
    assert results["resumed"] == results["function"]
    assert train_records(root / "resumed") == train_records(root / "function")
    evals = lambda workdir: [r for r in read_records(workdir) if r.get("split") == "test"]
    assert evals(root / "resumed") == evals(root / "function")


def test_a_function_that_takes_data_dir_gets_the_configs(tmp_path, monkeypatch):
    (tmp_path / "with_dir.py").write_text(
        "import numpy as np\n\n"
        "def make_source(split, data_dir=None):\n"
        "    return [{'x': np.float32(len(data_dir or ''))}] * 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    source = data.load_data_source("with_dir:make_source", "test", data_dir="/a/b")
    assert len(source) == 3 and float(source[0]["x"]) == 4.0


def test_tfds_slicing_of_a_function_split_takes_tfds_rows():
    whole = data.load_data_source(DIGITS_FUNCTION, "train")
    head = data.load_data_source(DIGITS_FUNCTION, "train[:90%]")
    tail = data.load_data_source(DIGITS_FUNCTION, "train[90%:]")
    assert len(head) + len(tail) == len(whole) == 1437 and len(head) == 1293
    rows, head_rows, tail_rows = all_rows(whole), all_rows(head), all_rows(tail)
    np.testing.assert_array_equal(
        np.concatenate([head_rows["image"], tail_rows["image"]]), rows["image"]
    )
    with pytest.raises(ConfigError, match="cannot read split 'train\\[:200%\\]'"):
        data.load_data_source(DIGITS_FUNCTION, "train[:200%]")


def test_tfds_names_with_a_colon_stay_tfds_names():
    assert user_sources.is_user_source("my_pkg.data:make_source")
    assert user_sources.is_user_source("array_record:/data/{split}.array_record")
    for name in ("mnist:3.*.*", "huggingface:mnist", "digits", "text_files/block_size=8,files=a"):
        assert not user_sources.is_user_source(name), name


@pytest.mark.parametrize("dataset, expected", BAD_INPUTS, ids=[d for d, _ in BAD_INPUTS])
def test_each_mistake_in_a_data_function_is_one_line_before_the_workdir(
    tmp_path, outside, example_importable, dataset, expected
):
    workdir = tmp_path / "run"
    config = regression_config(outside, dataset=dataset)
    with pytest.raises(UserError) as error:
        trainer.train_and_evaluate(config, str(workdir), quiet=True)
    assert isinstance(error.value, (ConfigError, DatasetError))
    assert expected in str(error.value) and "\n" not in str(error.value)
    assert not workdir.exists()


@pytest.mark.parametrize("dataset, expected", BAD_INPUTS, ids=[d for d, _ in BAD_INPUTS])
def test_the_command_line_says_each_data_mistake_in_one_line(tmp_path, outside, dataset, expected):
    if dataset.startswith("no_such_module"):  # found missing before setup, with where it looked
        expected = f"no module 'no_such_module' beside the config file ({outside})"
    workdir = tmp_path / "run"
    done = run_cli(
        "train", "--config", f"{outside}/config.py:smoke", "--workdir", str(workdir),
        f"--config.dataset={dataset}",
    )  # fmt: skip
    assert_one_line_error(done, expected)
    assert not workdir.exists()


# ---- Code beside a config file, outside the repository


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_the_regression_example_trains_from_the_repository_root(tmp_path):
    workdir = str(tmp_path / "run")
    done = run_cli("train", "--config", "examples/regression/config.py:smoke", "--workdir", workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_records(workdir)
    evals = [r["loss"] for r in records if r.get("split") == "test"]
    losses = [loss for _, loss in train_records(workdir)]
    # Predicting the mean scores 0.59: the MLP is well below it, and still improving.
    assert len(evals) == 2 and evals[1] < evals[0] < 0.3
    assert losses[-1] < losses[0]
    assert all(r["num_examples"] == 1024 for r in records if r.get("split") == "test")

    # eval of the run needs its modules: the run's config file says where they are.
    assert_one_line_error(
        run_cli("eval", "--workdir", workdir),
        "config.experiment='regression' cannot be imported",
        "pass the run's config file with --config FILE",
    )
    done = run_cli(
        "eval", "--workdir", workdir, "--config", "examples/regression/config.py", "--json"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f'"loss": {evals[1]}' in done.stdout


# ---- array_record files


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_array_record_files_train_exactly_like_the_function_that_wrote_them(
    tmp_path, outside, example_importable
):
    import regression_data

    paths = regression_data.write_records(str(tmp_path / "records"))
    assert [os.path.basename(p) for p in paths] == ["train.array_record", "test.array_record"]
    records = f"array_record:{tmp_path}/records/{{split}}.array_record"
    for split in ("train", "test"):
        assert_same_rows(
            data.load_data_source(records, split),
            data.load_data_source("regression_data:make_source", split),
        )
    results = {
        dataset: trainer.train_and_evaluate(
            regression_config(outside, dataset=dataset, num_train_steps=10, eval_every_steps=10),
            str(tmp_path / dataset.split(":")[0]),
            quiet=True,
        )
        for dataset in (records, "regression_data:make_source")
    }
    assert results[records] == results["regression_data:make_source"]
    assert results[records]["num_examples"] == 1024


def test_an_array_record_source_reads_several_files_as_one(tmp_path):
    for shard in range(3):
        data.write_array_records(
            tmp_path / f"part-{shard:05d}-of-00003.array_record",
            ({"x": np.full(2, 10 * shard + i, np.int32), "s": f"{shard}/{i}"} for i in range(4)),
        )
    source = data.ArrayRecordSource(str(tmp_path / "part-*.array_record"))
    assert len(source) == 12
    in_order = [*range(4), *range(10, 14), *range(20, 24)]  # the files by name, each in order
    assert [int(source[i]["x"][0]) for i in range(12)] == in_order
    batch = data.read_batch(source, [11, 0, 5])
    assert batch["x"][:, 1].tolist() == [23, 0, 11] and batch["s"].tolist() == ["2/3", "0/0", "1/1"]
    (tmp_path / "junk.array_record").write_bytes(b"not a record file")
    with pytest.raises(DatasetError, match="junk.array_record"):
        data.ArrayRecordSource(str(tmp_path / "junk.array_record"))[0]


def test_records_written_another_way_are_a_clear_error(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(tmp_path / "train.array_record"), "group_size:1")
    writer.write(b"\x0a\x03abc")  # a protobuf, say
    writer.close()
    with pytest.raises(DatasetError, match="is not an example written by write_array_records"):
        data.load_data_source(f"array_record:{tmp_path}/{{split}}.array_record", "train")


def test_array_record_files_in_a_bucket_are_read_through_one_copy_per_machine(bucket, tmp_path):
    local = tmp_path / "local"
    for split, n in (("train", 5), ("test", 3)):
        data.write_array_records(
            local / f"{split}-00000-of-00001.array_record",
            ({"x": np.arange(3, dtype=np.float32) + i} for i in range(n)),
        )
        name = f"{split}-00000-of-00001.array_record"
        storage.write_bytes(f"{bucket}/mine/{name}", (local / name).read_bytes())
    cache = tmp_path / "cache"
    pattern = f"{bucket}/mine/{{split}}-*.array_record"
    got = data.load_data_source(f"array_record:{pattern}", "train", cache_dir=str(cache))
    want = data.load_data_source(f"array_record:{local}/{{split}}-*.array_record", "train")
    assert len(got) == 5
    assert_same_rows(got, want)
    copies = [root for root, _, files in os.walk(cache) if remote.COMPLETE_MARKER in files]
    assert len(copies) == 1 and copies[0].startswith(str(cache / bucket.split("://")[1] / "mine"))
    # A second open reads the same copy; a changed file makes a new one.
    again = array_records.ArrayRecordSource(f"{bucket}/mine/train-*", cache_dir=str(cache))
    assert len(again) == 5
    data.write_array_records(local / "more.array_record", [{"x": np.zeros(3, np.float32)}])
    storage.write_bytes(f"{bucket}/mine/train-00000-of-00001.array_record",
                        (local / "more.array_record").read_bytes())  # fmt: skip
    assert len(array_records.ArrayRecordSource(f"{bucket}/mine/train-*", cache_dir=str(cache))) == 1
    with pytest.raises(DatasetError, match="no array_record file matches"):
        array_records.ArrayRecordSource(f"{bucket}/none/*.array_record", cache_dir=str(cache))


# ---- A tfds builder of one's own


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_a_builder_beside_the_config_is_built_where_it_is_with_no_flag(tmp_path, outside):
    data_dir, workdir = tmp_path / "tfds", tmp_path / "run"
    done = run_cli(
        "train", "--config", f"{outside}/config.py:smoke", "--workdir", str(workdir),
        "--config.dataset=regression_tfds:SyntheticRegression", f"--config.data_dir={data_dir}",
        "--config.num_train_steps=30",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (data_dir / "synthetic_regression" / "1.0.0" / "dataset_info.json").exists()
    evals = [r for r in read_records(workdir) if r.get("split") == "test"]
    assert evals[-1]["num_examples"] == 1024 and evals[-1]["loss"] < 0.59


def test_a_builder_in_a_package_is_built_or_says_what_tfds_lacks(tmp_path, monkeypatch):
    package = tmp_path / "own_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "squares.py").write_text(
        "import numpy as np\nimport tensorflow_datasets as tfds\n\n"
        "class OwnSquares(tfds.core.GeneratorBasedBuilder):\n"
        "    VERSION = tfds.core.Version('1.0.0')\n\n"
        "    def _info(self):\n"
        "        features = tfds.features.FeaturesDict(\n"
        "            {'x': tfds.features.Tensor(shape=(), dtype=np.int64)})\n"
        "        return tfds.core.DatasetInfo(builder=self, features=features)\n\n"
        "    def _split_generators(self, dl_manager):\n"
        "        return {'train': self._generate_examples(5)}\n\n"
        "    def _generate_examples(self, n):\n"
        "        for i in range(n):\n"
        "            yield i, {'x': i * i}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    name = "own_package.squares:OwnSquares"
    if importlib.util.find_spec("importlib_resources") is None:
        # tfds 4.9.10 imports it for builders in a package without depending on it.
        with pytest.raises(DatasetError, match="pip install importlib_resources"):
            data.load_data_source(name, "train", data_dir=str(tmp_path / "tfds"))
        return
    source = data.load_data_source(name, "train", data_dir=str(tmp_path / "tfds"))
    assert sorted(int(source[i]["x"]) for i in range(len(source))) == [0, 1, 4, 9, 16]


def test_a_catalog_builder_is_still_never_prepared(tmp_path):
    with pytest.raises(data.DatasetNotPreparedError, match="tfds build mnist"):
        data.load_data_source("mnist", "train", data_dir=str(tmp_path))


# ---- Doctests of the new modules


def test_the_example_data_module_runs_as_a_script(tmp_path):
    done = subprocess.run(
        [sys.executable, os.path.join(EXAMPLE, "regression_data.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(tmp_path / f"{s}.array_record") for s in ("train", "test")]
    assert len(data.ArrayRecordSource(str(tmp_path / "test.array_record"))) == 1024
