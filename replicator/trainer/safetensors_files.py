"""A directory of safetensors files, as Hugging Face writes one: read and written one
tensor at a time.

The format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian
header length, a JSON header naming each tensor's dtype, shape and byte range,
then the bytes. `SafetensorsDir` reads the headers only, and each tensor when
asked, through a memory map: nothing else of the checkpoint is in memory, so a
model larger than the host's free memory loads tensor by tensor. (The
``safetensors`` package's numpy reader refuses bfloat16, the dtype most
checkpoints are in; NumPy reads it through ``ml_dtypes``.) `write_file` writes a
file whose header it knows before any tensor exists, from each tensor's shape,
so the tensors can be made and written one after another.

A model over one file is split as Hugging Face splits it:
``model-00001-of-00003.safetensors`` ... and ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {name: file}}``).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Sequence

import ml_dtypes
import numpy as np

from replicator.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Hugging Face's default max_shard_size ("5GB", in its decimal units).
MAX_FILE_BYTES = 5 * 10**9

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsDir:
    """The tensors of a directory's ``*.safetensors`` files (with or without the index).

    Args:
      directory: a local directory holding ``model.safetensors``, or the files
        that ``model.safetensors.index.json`` names, or other ``*.safetensors``.

    Raises:
      ConfigError: no safetensors there, or a file that is not one.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> ones = np.ones((2, 3), np.float32)
    >>> write_file(os.path.join(d, SINGLE), [("w", (2, 3), np.float32)], [ones])
    >>> SafetensorsDir(d).shapes, float(SafetensorsDir(d).read("w").sum())
    ({'w': (2, 3)}, 6.0)
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self._where: dict[str, tuple[str, int]] = {}  # name -> (file, byte offset)
        for file in self._files():
            self._read_header(os.path.join(directory, file))

    def _files(self) -> list[str]:
        index = os.path.join(self.directory, INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{index} is not a safetensors index: {e}") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not os.path.isfile(os.path.join(self.directory, f))]
            if missing:
                raise ConfigError(f"{index} names files that are not there: {missing}")
            return files
        files = sorted(f for f in os.listdir(self.directory) if f.endswith(".safetensors"))
        if not files:
            raise ConfigError(
                f"{self.directory} holds no *.safetensors (a PyTorch .bin checkpoint? save it "
                "with save_pretrained(..., safe_serialization=True))"
            )
        return files

    def _read_header(self, path: str) -> None:
        """The tensors' names, shapes, dtypes and places in ``path``, each checked against
        the file: a truncated file or a garbage header is one `ConfigError`, never an
        ``mmap`` or ``OverflowError`` traceback later."""
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > size - 8:
                    raise ValueError(f"its header claims {length:,} bytes of a {size:,}-byte file")
                header = json.loads(f.read(length))
            if not isinstance(header, dict):
                raise ValueError("its header is no JSON object")
        except (OSError, ValueError, struct.error) as e:
            raise ConfigError(f"{path} is not a safetensors file: {e}") from None
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (start, end) = (
                    entry["dtype"],
                    tuple(entry["shape"]),
                    entry["data_offsets"],
                )
            except (KeyError, TypeError, ValueError):
                raise ConfigError(f"{path}: tensor {name}'s header entry is malformed") from None
            numbers = (*shape, start, end)
            if not isinstance(dtype, str) or not all(type(n) is int and n >= 0 for n in numbers):
                raise ConfigError(f"{path}: tensor {name}'s header entry is malformed")
            if dtype not in DTYPES:
                raise ConfigError(f"{path}: tensor {name} has dtype {dtype}, not read here")
            needed = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
            if not 0 <= start <= end or end - start != needed or 8 + length + end > size:
                raise ConfigError(
                    f"{path}: tensor {name} {shape} does not fit the file (bytes {start}-{end} "
                    f"of {size - 8 - length:,} after the header): a truncated or damaged "
                    "download? Fetch the file again"
                )
            self.shapes[name] = shape
            self.dtypes[name] = DTYPES[dtype]
            self._where[name] = (path, 8 + length + start)

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name``, memory-mapped: its bytes are read when used."""
        path, offset = self._where[name]
        shape, dtype = self.shapes[name], self.dtypes[name]
        if math.prod(shape) == 0:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def write_file(
    path: str,
    tensors: Sequence[tuple[str, tuple[int, ...], np.dtype]],
    arrays: Iterable[np.ndarray],
) -> None:
    """Writes a safetensors file of ``tensors`` (name, shape, dtype), in that order.

    The header comes first, from the shapes alone; then each tensor's bytes as
    ``arrays`` gives them (in the same order), one at a time: a generator that
    makes each when asked keeps one tensor in memory.

    Raises:
      ValueError: an array whose shape or dtype is not the one announced.
    """
    header: dict = {"__metadata__": {"format": "pt"}}  # transformers reads "pt" files only
    offset = 0
    for name, shape, dtype in tensors:
        size = math.prod(shape) * np.dtype(dtype).itemsize
        entry = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape)}
        header[name] = {**entry, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the bytes start 8-aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for (name, shape, dtype), array in zip(tensors, arrays, strict=True):
            array = np.asarray(array)
            if array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
                raise ValueError(
                    f"{name}: made {array.shape} {array.dtype}, announced {shape} {dtype}"
                )
            f.write(np.ascontiguousarray(array).tobytes())  # little-endian hosts, as the format


def file_names(count: int) -> list[str]:
    """Hugging Face's names for a model in ``count`` files.

    >>> file_names(1), file_names(3)[2]
    (['model.safetensors'], 'model-00003-of-00003.safetensors')
    """
    if count == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index(directory: str, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json``: which file holds each tensor."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
