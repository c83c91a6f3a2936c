"""``python -m replicator export --workdir W [--step N] --format hf|peft --out DIR``.

Writes a run's parameters as a Hugging Face checkpoint: ``config.json``, the
weights as safetensors in the model family's own names and layouts (split into
files of at most 5 GB with ``model.safetensors.index.json``, as
``save_pretrained`` splits them) and the run's tokenizer, so that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` (and vLLM, and any
tool of that world) loads it. The experiment maps names and layouts through its
``hf_checkpoint`` hook (`replicator.trainer.pretrained`); the family follows the
run's model keys. The weights are float32 unless ``dtype`` says otherwise
(``--dtype bfloat16``, as most checkpoints on the Hub are: half the bytes).

The tokenizer: the experiment module's optional hook ``write_tokenizer(spec,
directory) -> names`` writes ``config.tokenizer`` as
``transformers.AutoTokenizer.from_pretrained(DIR)`` loads it, with the run's ids
(``experiments.lm``'s converts a tiktoken file to a ``tokenizer.json``, writes a
sentencepiece model as ``tokenizer.model`` and always a ``tokenizer_config.json``
with the end and start tokens); without the hook, the layout's ``files`` are copied.

The checkpoint is restored onto the devices there are, sharded as the run's mesh
shards it; then each parameter, one layer of a stack at a time, is gathered to
the host, turned into its Hugging Face tensors and written, before the next is
gathered: the host never holds more than one layer's tensors. Each file's header
is written first, from the shapes alone (`safetensors_files.write_file`).

A run with LoRA adapters (the LM's ``model.lora_rank``): ``--format hf`` writes the
merged weights (each adapted kernel ``W + (alpha / rank) A B``, a QLoRA kernel
dequantized first), plain Hugging Face weights. ``--format peft`` writes Hugging Face
PEFT's layout instead (`export_peft`): ``adapter_config.json`` and
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(base, DIR)`` loads
onto the base model ``base``, named by the config's ``base_model_name_or_path``: the
run's ``init_from='hf:BASE'`` directory where the run's frozen base is that checkpoint's
weights as they are (no QLoRA, no ``init_from_skip``); else the base is exported too,
dequantized, into ``DIR/base/`` (with the tokenizer's files), and named there.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import jax
import ml_dtypes
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

FORMATS = ("hf", "peft")
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


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
            f"{len(self.files)} files, {_size(self.num_bytes)} of weights"
        )


def _size(num_bytes: int) -> str:
    """``'0.5 MB'``, or kB below a tenth of a MB (a small run's adapters).

    >>> _size(524_288), _size(33_000)
    ('0.5 MB', '33.0 kB')
    """
    return f"{num_bytes / 1e6:.1f} MB" if num_bytes >= 1e5 else f"{num_bytes / 1e3:.1f} kB"


@dataclasses.dataclass(frozen=True)
class _Group:
    """One parameter (one layer of a stack), the others its tensors are made with
    (`pretrained.HFTensor.also`), and the tensors they become."""

    tensor: pretrained.HFTensor
    paths: tuple[str, ...]
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
    dtype: str | None = None,
) -> Exported:
    """Writes checkpoint ``step`` (default: the newest) of the run in ``workdir`` to ``out``
    in Hugging Face's layout.

    Args:
      workdir: a training run's directory (its ``config.json`` and checkpoints).
      out: a local directory, new or empty.
      step: the checkpoint's step; None: the newest.
      devices: the devices to restore onto (default: all).
      max_file_bytes: the largest safetensors file (Hugging Face's 5 GB).
      dtype: the floating weights' dtype, a name of `DTYPES`; None: the parameters'.

    Returns:
      What was written (`Exported`).

    Raises:
      UsageError: ``out`` is not empty, or not local.
      ConfigError: no run or no checkpoint in ``workdir``; an experiment without the
        hook; model keys that no Hugging Face family has.
    """
    _check_out(out)
    dtype = _dtype(dtype)
    config = _config(workdir)
    hf = pretrained.layout(
        config.experiment, config.model.to_dict(), None, tokenizer=config.get("tokenizer")
    )
    leaves, step = _restored(config, workdir, step, devices)
    tokenizer = _tokenizer_writer(config)
    return _export_weights(out, hf, leaves, step, max_file_bytes, dtype, tokenizer)


def export_peft(
    workdir: str,
    out: str,
    *,
    step: int | None = None,
    devices=None,
    max_file_bytes: int = MAX_FILE_BYTES,
    dtype: str | None = None,
) -> Exported:
    """Writes the adapters of checkpoint ``step`` of the run in ``workdir`` to ``out`` in
    Hugging Face PEFT's layout (the module docstring says which base they load onto).

    Args:
      workdir: a training run's directory, of a run with adapters.
      out: a local directory, new or empty.
      step: the checkpoint's step; None: the newest.
      devices: the devices to restore onto (default: all).
      max_file_bytes: the largest safetensors file of an exported base.
      dtype: the floating weights' dtype (adapters and base), a name of `DTYPES`.

    Returns:
      What was written (`Exported`): the adapters' files (and ``base/...``'s).

    Raises:
      UsageError: ``out`` is not empty, or not local.
      ConfigError: no run, no checkpoint, or a run without adapters (nothing written).
    """
    _check_out(out)
    dtype = _dtype(dtype)
    config = _config(workdir)
    model, tokenizer = config.model.to_dict(), config.get("tokenizer")
    hf = pretrained.layout(config.experiment, model, None, tokenizer=tokenizer)
    if not hf.adapters:
        raise ConfigError(
            f"the run in {workdir} has no adapters to export as PEFT's (config.model.lora_rank"
            f"={model.get('lora_rank', 0)}): export --format hf writes its weights"
        )
    leaves, step = _restored(config, workdir, step, devices)
    base = _base_checkpoint(config)
    written, exported_base = [], None
    if base is None:  # the frozen base is no checkpoint on disk: written beside
        base_hf = pretrained.layout(config.experiment, model, None, tokenizer=tokenizer, base=True)
        base = os.path.abspath(os.path.join(out, "base"))
        exported_base = _export_weights(
            base, base_hf, leaves, step, max_file_bytes, dtype, _tokenizer_writer(config)
        )
        written += [f"base/{name}" for name in exported_base.files]
    groups = _groups(hf.adapters, leaves, dtype)
    if jax.process_index() == 0:
        os.makedirs(out, exist_ok=True)
    _write_file(os.path.join(out, ADAPTER_WEIGHTS), groups, leaves)
    if jax.process_index() == 0:
        adapter_config = {**hf.adapter_config, "base_model_name_or_path": base}
        _write_json(os.path.join(out, ADAPTER_CONFIG), adapter_config)
    written += [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
    summary = f"PEFT LoRA adapters of {hf.summary}; base {base}"
    num_bytes = sum(g.num_bytes for g in groups)
    return Exported(out, step, summary, tuple(written), num_bytes)


def export_run(workdir: str, out: str, *, format: str = "hf", **kwargs: Any) -> Exported:
    """`export_hf` (``format='hf'``) or `export_peft` (``'peft'``), ``kwargs`` theirs."""
    if format not in FORMATS:
        raise UsageError(f"--format {format!r}: use one of {', '.join(FORMATS)}")
    return (export_peft if format == "peft" else export_hf)(workdir, out, **kwargs)


def _dtype(name: str | None) -> np.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise UsageError(f"--dtype {name!r}: use one of {', '.join(DTYPES)}")
    return np.dtype(DTYPES[name])


def _config(workdir: str):
    config = run_config(workdir)
    if config is None:
        raise ConfigError(
            f"{storage.join(workdir, 'config.json')} does not exist: no run to export"
        )
    return config


def _restored(config, workdir: str, step: int | None, devices) -> tuple[dict[str, Any], int]:
    """The checkpoint's parameters by path (`init_from.model_paths`), and its step."""
    run = setup(config, devices=devices, training=False)
    try:
        restored = restore_params(run, workdir, step=step)
    finally:
        run.close()
    if restored is None:
        raise ConfigError(f"{workdir} holds no checkpoint to export")
    params, step = restored
    return init_from.model_paths({"params": params}), step


def _base_checkpoint(config) -> str | None:
    """The ``hf:DIR`` checkpoint whose weights are the run's frozen base as they are: the
    run's ``init_from``, unless QLoRA stores it otherwise, ``init_from_skip`` left some
    fresh, or the directory is gone."""
    spec = config.get("init_from")
    if not pretrained.is_pretrained(spec) or config.get("init_from_skip"):
        return None
    if config.model.get("lora_quantize") is not None:
        return None
    directory = os.path.abspath(os.path.expanduser(spec[len(pretrained.PREFIX) :]))
    return directory if os.path.isdir(directory) else None


def _tokenizer_writer(config) -> Callable[[str], Any] | None:
    """``directory -> names``: the experiment's ``write_tokenizer`` hook for the run's
    ``config.tokenizer``, or None (no tokenizer, or no hook: the layout's files are copied)."""
    hook = getattr(importlib.import_module(config.experiment), "write_tokenizer", None)
    spec = config.get("tokenizer")
    return functools.partial(hook, spec) if callable(hook) and spec else None


def _export_weights(
    out: str, hf, leaves, step: int, max_file_bytes: int, dtype: np.dtype | None = None,
    write_tokenizer: Callable[[str], Any] | None = None,
) -> Exported:  # fmt: skip
    groups = _groups(hf.tensors, leaves, dtype)
    files = _split(groups, max_file_bytes)
    written = _write(out, hf, leaves, files, write_tokenizer)
    return Exported(out, step, hf.summary, written, sum(g.num_bytes for g in groups))


def _check_out(out: str) -> None:
    if storage.is_remote(out):
        raise UsageError(
            f"--out {out}: export writes a local directory (copy it to a bucket after)"
        )
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"--out {out} exists and is not an empty directory")


def _groups(
    tensors: tuple[pretrained.HFTensor, ...], leaves: dict[str, Any], asked: np.dtype | None = None
) -> list[_Group]:
    """Every parameter (layer) in the layout's order, with its tensors' names and shapes,
    in the dtype of the first floating one among it and its `HFTensor.also` (a QLoRA
    kernel's codes are not, its scales are), or ``asked`` where that one is floating."""
    groups = []
    for tensor in tensors:
        paths = tuple(pretrained.state_path(p, leaves) for p in (tensor.path, *tensor.also))
        if None in paths:  # the hook names a parameter that the model does not make: a bug
            missing = (tensor.path, *tensor.also)[paths.index(None)]
            raise RuntimeError(f"the run's parameters have no params/{missing}")
        dtypes = [np.dtype(leaves[p].dtype) for p in paths]
        floating = [d for d in dtypes if np.issubdtype(d, np.floating) or d == ml_dtypes.bfloat16]
        dtype = (asked or floating[0]) if floating else dtypes[0]
        for layer in range(tensor.layers) if tensor.layers else [None]:
            names = tensor.names_of(layer)
            entries = [(n, tuple(s), dtype) for n, s in zip(names, tensor.shapes, strict=True)]
            groups.append(_Group(tensor, paths, layer, entries))
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


def _write(
    out: str, hf: pretrained.HFLayout, leaves, files: list[list[_Group]], write_tokenizer=None
) -> tuple[str, ...]:
    """The files, one tensor in memory at a time; only process 0 writes, every process
    takes part in the gathers."""
    chief = jax.process_index() == 0
    if chief:
        os.makedirs(out, exist_ok=True)
    names = file_names(len(files))
    weight_map, total = {}, 0
    for name, groups in zip(names, files, strict=True):
        _write_file(os.path.join(out, name), groups, leaves)
        weight_map.update({entry[0]: name for group in groups for entry in group.entries})
        total += sum(g.num_bytes for g in groups)
    written = list(names)
    if not chief:
        return tuple(written)
    if len(names) > 1:
        write_index(out, weight_map, total)
        written.append("model.safetensors.index.json")
    _write_json(os.path.join(out, "config.json"), _config_json(hf.config, files))
    written.append("config.json")
    if write_tokenizer is not None:
        return (*written, *write_tokenizer(out))
    for path in hf.files:
        shutil.copy(path, out)
    return (*written, *(os.path.basename(path) for path in hf.files))


def _config_json(config: dict[str, Any], files: list[list[_Group]]) -> dict[str, Any]:
    """The layout's ``config.json``, its ``torch_dtype`` the weights' as written."""
    dtypes = {np.dtype(e[2]) for groups in files for g in groups for e in g.entries}
    floating = [d for d in dtypes if np.issubdtype(d, np.floating) or d == ml_dtypes.bfloat16]
    if "torch_dtype" not in config or len(floating) != 1:
        return config
    return {**config, "torch_dtype": str(floating[0])}


def _write_file(path: str, groups: list[_Group], leaves: dict[str, Any]) -> None:
    """One safetensors file of ``groups``' tensors; every process gathers, process 0 writes."""
    entries = [entry for group in groups for entry in group.entries]
    arrays = _arrays(groups, leaves)
    if jax.process_index() == 0:
        write_file(path, entries, arrays)
    else:
        for _ in arrays:
            pass


def _write_json(path: str, value: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")


def _arrays(groups: list[_Group], leaves: dict[str, Any]) -> Iterator[np.ndarray]:
    """Each group's tensors, made when asked: the parameter (layer) and those it is made
    with gathered to the host, then turned into Hugging Face's layout."""
    for group in groups:
        made = group.tensor.to_hf(*(_gather(leaves[p], group.layer) for p in group.paths))
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
