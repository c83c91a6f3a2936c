"""``python -m replicator export --workdir W [--step N] --format hf --out DIR``.

Writes a run's parameters as a Hugging Face checkpoint: ``config.json``, the
weights as safetensors in the model family's own names and layouts (split into
files of at most 5 GB with ``model.safetensors.index.json``, as
``save_pretrained`` splits them) and the run's tokenizer files, so that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` (and vLLM, and any
tool of that world) loads it. The experiment maps names and layouts through its
``hf_checkpoint`` hook (`replicator.trainer.pretrained`); the family follows the
run's model keys.

The checkpoint is restored onto the devices there are, sharded as the run's mesh
shards it; then each parameter, one layer of a stack at a time, is gathered to
the host, turned into its Hugging Face tensors and written, before the next is
gathered: the host never holds more than one layer's tensors. Each file's header
is written first, from the shapes alone (`safetensors_files.write_file`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from replicator import storage
from replicator.errors import ConfigError, UsageError
from replicator.trainer import init_from, pretrained
from replicator.trainer.evaluator import restore_params, run_config
from replicator.trainer.safetensors_files import (
    MAX_FILE_BYTES,
    file_names,
    write_file,
    write_index,
)
from replicator.trainer.setup import setup

FORMATS = ("hf",)


@dataclasses.dataclass(frozen=True)
class Exported:
    """What `export_hf` wrote.

    Attributes:
      directory: the export's directory.
      step: the checkpoint's step.
      summary: the layout's line (family, layers, widths, vocab).
      files: every file written, by name.
      num_bytes: the weights' bytes.
    """

    directory: str
    step: int
    summary: str
    files: tuple[str, ...]
    num_bytes: int

    def report(self) -> str:
        """The console's line."""
        return (
            f"exported step {self.step} to {self.directory}: {self.summary}; "
            f"{len(self.files)} files, {self.num_bytes / 1e6:.1f} MB of weights"
        )


@dataclasses.dataclass(frozen=True)
class _Group:
    """One parameter (one layer of a stack) and the tensors it becomes."""

    tensor: pretrained.HFTensor
    path: str
    layer: int | None
    entries: list[tuple[str, tuple[int, ...], np.dtype]]

    @property
    def num_bytes(self) -> int:
        return sum(
            int(np.prod(shape)) * np.dtype(dtype).itemsize for _, shape, dtype in self.entries
        )


def export_hf(
    workdir: str,
    out: str,
    *,
    step: int | None = None,
    devices=None,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> Exported:
    """Writes checkpoint ``step`` (default: the newest) of the run in ``workdir`` to ``out``
    in Hugging Face's layout.

    Args:
      workdir: a training run's directory (its ``config.json`` and checkpoints).
      out: a local directory, new or empty.
      step: the checkpoint's step; None: the newest.
      devices: the devices to restore onto (default: all).
      max_file_bytes: the largest safetensors file (Hugging Face's 5 GB).

    Returns:
      What was written (`Exported`).

    Raises:
      UsageError: ``out`` is not empty, or not local.
      ConfigError: no run or no checkpoint in ``workdir``; an experiment without the
        hook; model keys that no Hugging Face family has.
    """
    _check_out(out)
    config = run_config(workdir)
    if config is None:
        raise ConfigError(
            f"{storage.join(workdir, 'config.json')} does not exist: no run to export"
        )
    hf = pretrained.layout(
        config.experiment, config.model.to_dict(), None, tokenizer=config.get("tokenizer")
    )
    run = setup(config, devices=devices, training=False)
    try:
        restored = restore_params(run, workdir, step=step)
    finally:
        run.close()
    if restored is None:
        raise ConfigError(f"{workdir} holds no checkpoint to export")
    params, step = restored
    leaves = init_from.model_paths({"params": params})
    groups = _groups(hf, leaves)
    files = _split(groups, max_file_bytes)
    written = _write(out, hf, leaves, files)
    return Exported(out, step, hf.summary, written, sum(g.num_bytes for g in groups))


def _check_out(out: str) -> None:
    if storage.is_remote(out):
        raise UsageError(
            f"--out {out}: export writes a local directory (copy it to a bucket after)"
        )
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"--out {out} exists and is not an empty directory")


def _groups(hf: pretrained.HFLayout, leaves: dict[str, Any]) -> list[_Group]:
    """Every parameter (layer) in the layout's order, with its tensors' names and shapes."""
    groups = []
    for tensor in hf.tensors:
        path = pretrained.state_path(tensor.path, leaves)
        if path is None:  # the hook names a parameter that the model does not make: a bug
            raise RuntimeError(f"the run's parameters have no params/{tensor.path}")
        dtype = np.dtype(leaves[path].dtype)
        for layer in range(tensor.layers) if tensor.layers else [None]:
            names = tensor.names_of(layer)
            entries = [(n, tuple(s), dtype) for n, s in zip(names, tensor.shapes, strict=True)]
            groups.append(_Group(tensor, path, layer, entries))
    return groups


def _split(groups: list[_Group], max_file_bytes: int) -> list[list[_Group]]:
    """Groups into files of at most ``max_file_bytes`` (a larger group alone in its own)."""
    files: list[list[_Group]] = [[]]
    size = 0
    for group in groups:
        if files[-1] and size + group.num_bytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(group)
        size += group.num_bytes
    return files


def _write(out: str, hf: pretrained.HFLayout, leaves, files: list[list[_Group]]) -> tuple[str, ...]:
    """The files, one tensor in memory at a time; only process 0 writes, every process
    takes part in the gathers."""
    chief = jax.process_index() == 0
    if chief:
        os.makedirs(out, exist_ok=True)
    names = file_names(len(files))
    weight_map, total = {}, 0
    for name, groups in zip(names, files, strict=True):
        entries = [entry for group in groups for entry in group.entries]
        arrays = _arrays(groups, leaves)
        if chief:
            write_file(os.path.join(out, name), entries, arrays)
        else:
            for _ in arrays:
                pass
        weight_map.update({entry[0]: name for entry in entries})
        total += sum(g.num_bytes for g in groups)
    written = list(names)
    if not chief:
        return tuple(written)
    if len(names) > 1:
        write_index(out, weight_map, total)
        written.append("model.safetensors.index.json")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf.config, f, indent=2, sort_keys=True)
        f.write("\n")
    written.append("config.json")
    for path in hf.files:
        shutil.copy(path, out)
        written.append(os.path.basename(path))
    return tuple(written)


def _arrays(groups: list[_Group], leaves: dict[str, Any]) -> Iterator[np.ndarray]:
    """Each group's tensors, made when asked: the parameter (layer) gathered to the host,
    then turned into Hugging Face's layout."""
    for group in groups:
        host = _gather(leaves[group.path], group.layer)
        made = group.tensor.to_hf(host)
        for (_, _, dtype), array in zip(group.entries, made, strict=True):
            yield np.asarray(array, dtype)


@jax.jit
def _layer_of(stack: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(stack, i, 0, keepdims=False)


def _gather(leaf: jax.Array, layer: int | None) -> np.ndarray:
    """``leaf`` (its ``layer``) whole on this host."""
    x = leaf if layer is None else _layer_of(leaf, np.int32(layer))
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
