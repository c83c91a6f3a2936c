"""Data of one's own, without a tfds builder: a Python function, or array_record files.

A config's ``dataset`` names a split's examples in one of these ways
(`replicator.trainer.data.load_data_source`):

* a tfds name (``digits``, ``mnist:3.*.*``, ``text_files/block_size=128,...``);
* ``'MODULE:FUNCTION'``: ``FUNCTION(split)``, or ``FUNCTION(split, data_dir=...)``
  if it takes a ``data_dir`` (the config's), returns the split as a
  random-access source: ``len(source)`` and ``source[i]``, a dict of numpy
  arrays (grain's ``RandomAccessDataSource`` protocol; a list of dicts is one).
  ``'MODULE:CLASS'`` naming a ``tfds.core.DatasetBuilder`` reads that builder's
  dataset (imported, hence registered with tfds);
* ``'array_record:PATTERN'``: files written by `write_array_records`, the
  split's name standing for ``{split}`` in the pattern
  (``array_record:/data/mine/{split}-*.array_record``; local or ``gs://``).

The module is imported from ``sys.path``; ``python -m replicator`` puts the
config file's directory first on it, so modules beside the config file are
found; elsewhere, set ``PYTHONPATH``. A split with tfds' slicing
(``train[:90%]``, ``train[-100:]``, ``train+test``) calls the function with
the plain names and takes tfds' rows of them, so one data set can give both a
train and an eval split. The function runs in every process, each time the
trainer opens the split (train: once; eval: once per run or ``eval`` command):
it must return the same examples in the same order everywhere. Each process
then reads only its own rows, through the same iterators as tfds data.

Mistakes are one line (`ConfigError`), found when the split is opened, which
``train`` does for the eval split before it writes anything: a module or
function that cannot be imported, a function that raises, a result without
``__len__``/``__getitem__``, an empty split, items that are not dicts of
arrays, or items whose keys, shapes or dtypes differ (checked on up to
`NUM_CHECKED` items spread over the split; a later odd one out stops training
with the same kind of line).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from replicator.errors import ConfigError, UserError
from replicator.trainer.data.array_records import ArrayRecordSource
from replicator.trainer.data.records import Example, _read_examples

ARRAY_RECORD = "array_record:"
NUM_CHECKED = 16  # items read to check a source's examples when it is opened

_FUNCTION = re.compile(r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<name>[A-Za-z_]\w*)")
_PLAIN_SPLIT = re.compile(r"[^\[\]+]+")
_WHERE = (
    "modules are imported from sys.path: the config file's directory (python -m replicator "
    "puts it there), the working directory and PYTHONPATH"
)


def is_user_source(name: str) -> bool:
    """Whether dataset ``name`` is ``'MODULE:FUNCTION'`` or ``'array_record:PATTERN'``
    rather than a tfds name (``huggingface:mnist``, a tfds namespace, stays tfds').

    >>> [is_user_source(n) for n in ("my_data:make_source", "mnist:3.*.*", "digits")]
    [True, False, False]
    """
    if name.startswith(ARRAY_RECORD):
        return True
    match = _FUNCTION.fullmatch(name)
    return match is not None and not _is_tfds_namespace(match["module"])


def builder_class(name: str) -> type[tfds.core.DatasetBuilder] | None:
    """The tfds builder class that ``'MODULE:CLASS'`` names, or None if it names
    anything else (importing it registers the builder with tfds)."""
    if name.startswith(ARRAY_RECORD):
        return None
    target = _import(name)
    if isinstance(target, type) and issubclass(target, tfds.core.DatasetBuilder):
        return target
    return None


def open_split(
    name: str,
    split: str,
    *,
    data_dir: str | None = None,
    cache_dir: str | None = None,
) -> Sequence[Example]:
    """Opens ``split`` of a function or array_record dataset, checked (see above).

    Args:
        name: ``'MODULE:FUNCTION'`` or ``'array_record:PATTERN'``.
        split: a split name, or tfds' slicing of split names (``train[:90%]``).
        data_dir: passed to a function that takes ``data_dir``.
        cache_dir: where copies of array_record files in a bucket go.

    Returns:
        The split's random-access source.

    Raises:
        ConfigError: a function that cannot be imported or raises, a source without
            ``__len__``/``__getitem__``, an empty split, or items that are not dicts
            of arrays of one shape and dtype per key.
        replicator.errors.DatasetError: array_record files that are missing or
            hold other records.

    >>> open_split("builtins:list", "abc")  # list("abc"): no dicts  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    replicator.errors.ConfigError: dataset 'builtins:list' split 'abc': item 0 is a str, ...
    """
    if name.startswith(ARRAY_RECORD):
        pattern = name[len(ARRAY_RECORD) :]
        if "{split}" not in pattern:
            raise ConfigError(
                f"dataset {name!r}: the pattern needs '{{split}}' where the split's name "
                "goes, e.g. array_record:/data/mine/{split}-*.array_record"
            )

        def open_named(plain: str) -> Any:
            return ArrayRecordSource(pattern.replace("{split}", plain), cache_dir=cache_dir)

    else:
        function = _import(name)
        if not callable(function):
            raise ConfigError(
                f"dataset {name!r}: {name.split(':')[1]} = {function!r:.40} is not a function "
                "of the split's name"
            )

        def open_named(plain: str) -> Any:
            return _call(function, name, plain, data_dir)

    checked = lambda plain: _check_protocol(open_named(plain), name, plain)
    source = _select_rows(split, checked, name)
    check_examples(source, f"dataset {name!r} split {split!r}")
    return source


def check_examples(source: Sequence[Example], what: str) -> None:
    """Raises a `ConfigError` unless ``source`` is non-empty and its items (up to
    `NUM_CHECKED`, first and last included) are dicts of arrays that agree in keys,
    shapes and dtypes. ``what`` names the source in the message."""
    size = _length(source, what)
    if size <= 0:
        raise ConfigError(f"{what} is empty: len() returned {size}")
    checked = np.unique(np.linspace(0, size - 1, min(size, NUM_CHECKED)).round().astype(int))
    first = None
    for index in checked.tolist():
        try:
            item = source[index]
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001  (the user's code: one line, cause kept)
            raise ConfigError(f"{what}: reading item {index} raised {_described(e)}") from e
        layout = _layout(item, f"{what}: item {index}")
        if first is None:
            first = index, layout
        elif layout != first[1]:
            raise ConfigError(
                f"{what}: items {first[0]} and {index} differ: {_difference(first, index, layout)};"
                " every item needs the same keys, and each key one shape and dtype "
                "(batches stack them)"
            )


def _is_tfds_namespace(prefix: str) -> bool:
    from tensorflow_datasets.core import community

    return prefix == "huggingface" or community.community_register().has_namespace(prefix)


def _import(name: str) -> Any:
    module_name, attribute = name.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise  # the module itself imports something missing: a bug, with its traceback
        raise ConfigError(f"dataset {name!r}: no module named {e.name!r}; {_WHERE}") from e
    if not hasattr(module, attribute):
        defined = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", "") == module_name
        )
        raise ConfigError(
            f"dataset {name!r}: module {module_name} ({getattr(module, '__file__', '?')}) has "
            f"no {attribute!r}; its functions and classes: {', '.join(defined) or 'none'}"
        )
    return getattr(module, attribute)


def _call(function: Callable, name: str, split: str, data_dir: str | None) -> Any:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: the split only
        parameters = []
    takes = any(p.name == "data_dir" or p.kind is p.VAR_KEYWORD for p in parameters)
    try:
        return function(split, data_dir=data_dir) if takes else function(split)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  (the user's code: one line, cause kept)
        called = f"{getattr(function, '__name__', name)}({split!r})"
        raise ConfigError(f"dataset {name!r}: {called} raised {_described(e)}") from e


def _described(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _a(noun: str) -> str:
    """``noun`` with its article.

    >>> _a("int"), _a("list")
    ('an int', 'a list')
    """
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _check_protocol(source: Any, name: str, split: str) -> Any:
    missing = [m for m in ("__len__", "__getitem__") if not hasattr(type(source), m)]
    if missing or isinstance(source, (str, bytes, dict)):
        lacks = f"has no {' or '.join(missing)}" if missing else "is not a sequence of examples"
        raise ConfigError(
            f"dataset {name!r} split {split!r}: the function returned {_a(type(source).__name__)}, "
            f"which {lacks}; return a random-access source: "
            "len(source) and source[i] -> dict of numpy arrays (a list of such dicts is one)"
        )
    return source


def _length(source: Any, what: str) -> int:
    try:
        size = len(source)
    except Exception as e:  # noqa: BLE001  (the user's code: one line, cause kept)
        raise ConfigError(f"{what}: len() raised {_described(e)}") from e
    return size


def _layout(item: Any, what: str, prefix: str = "") -> dict[str, tuple]:
    """``{key: (shape, dtype)}`` of an example (nested keys joined by '/')."""
    if not isinstance(item, dict):
        raise ConfigError(
            f"{what} is a {type(item).__name__}, not a dict of numpy arrays, "
            "e.g. {'x': np.float32[3], 'y': np.int64 scalar}"
        )
    if not item and not prefix:
        raise ConfigError(f"{what} is an empty dict")
    layout = {}
    for key, value in item.items():
        path = f"{prefix}{key}"
        if not isinstance(key, str):
            raise ConfigError(f"{what} has a key {key!r} of type {type(key).__name__}, not str")
        if isinstance(value, dict):
            layout.update(_layout(value, what, f"{path}/"))
        elif isinstance(value, (str, bytes)):
            layout[path] = ((), type(value).__name__)  # any length: stacked as objects
        elif isinstance(value, (np.ndarray, np.generic, bool, int, float, complex)):
            array = np.asarray(value)
            if array.dtype.kind not in "biufcSU":
                raise ConfigError(f"{what}: {path!r} is an array of {array.dtype}, not numbers")
            layout[path] = (array.shape, str(array.dtype))
        else:
            raise ConfigError(
                f"{what}: {path!r} is a {type(value).__name__}; values are numpy arrays, "
                "numbers or strings (np.asarray(...) it)"
            )
    return layout


def _difference(first: tuple[int, dict], index: int, layout: dict) -> str:
    first_index, reference = first
    if reference.keys() != layout.keys():
        return f"keys {sorted(reference)} and {sorted(layout)}"
    key = next(k for k in reference if reference[k] != layout[k])
    shown = lambda entry: f"{entry[1]}{list(entry[0])}"
    return (
        f"{key!r} is {shown(reference[key])} in item {first_index} and {shown(layout[key])} "
        f"in item {index}"
    )


def _select_rows(split: str, open_named: Callable[[str], Any], name: str) -> Any:
    """The source of ``split``: a plain name as the function returns it; tfds' slicing
    (``train[:90%]+test``) as the same rows tfds would take of the named splits."""
    if _PLAIN_SPLIT.fullmatch(split):
        return open_named(split)
    opened: dict[str, Any] = {}
    parts = []
    for spec in split.split("+"):
        try:
            instruction = tfds.core.ReadInstruction.from_spec(spec.strip())
        except (ValueError, NotImplementedError) as e:
            raise ConfigError(f"dataset {name!r}: cannot read split {split!r}: {e}") from e
        plain = getattr(instruction, "split_name", None)
        if plain is None:  # 'all': a function has no list of its splits
            raise ConfigError(f"dataset {name!r}: split {spec!r} needs a split's name")
        if plain not in opened:
            opened[plain] = open_named(plain)
        size = _length(opened[plain], f"dataset {name!r} split {plain!r}")
        info = tfds.core.SplitInfo(name=plain, shard_lengths=[size], num_bytes=0)
        try:
            (rows,) = instruction.to_absolute({plain: info})
        except ValueError as e:
            raise ConfigError(f"dataset {name!r}: cannot read split {split!r}: {e}") from e
        parts.append((opened[plain], rows.from_ or 0, size if rows.to is None else rows.to))
    if len(parts) == 1 and parts[0][1:] == (0, len(parts[0][0])):
        return parts[0][0]
    return Rows(parts)


class Rows(Sequence[Example]):
    """Rows ``[start, stop)`` of several sources, one after another, as one source.

    >>> rows = Rows([(list("abcdef"), 4, 6), (list("xyz"), 0, 2)])
    >>> len(rows), list(rows), rows.__getitems__([3, 0])
    (4, ['e', 'f', 'x', 'y'], ['y', 'e'])
    """

    def __init__(self, parts: Sequence[tuple[Sequence[Example], int, int]]):
        self._parts = list(parts)
        self._ends = np.cumsum([stop - start for _, start, stop in self._parts])

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, index: int) -> Example:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} rows")
        return self.__getitems__([index % len(self)])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Example]:
        """The rows at ``indices``, read with one call per source they come from."""
        indices = np.asarray(indices, np.int64)
        part = np.searchsorted(self._ends, indices, side="right")
        offsets = indices - np.concatenate([[0], self._ends])[part]
        found: list[Any] = [None] * len(indices)
        for p in np.unique(part).tolist():
            source, start, _ = self._parts[p]
            where = np.flatnonzero(part == p)
            for i, example in zip(where, _read_examples(source, offsets[where] + start)):
                found[i] = example
        return found

    def __repr__(self) -> str:
        return f"Rows({[(source, start, stop) for source, start, stop in self._parts]!r})"
