"""Hugging Face checkpoints in: ``init_from='hf:DIR'``, and the hook that maps them.

``config.init_from = 'hf:DIR'`` names a local Hugging Face checkpoint: its
``config.json`` and ``*.safetensors`` (one file, or several with
``model.safetensors.index.json``). The trainer knows nothing of any model's
names: the experiment module maps them, through an optional hook beside its
``make_experiment``::

    def hf_checkpoint(model: dict, hf_config: dict | None = None, *,
                      tokenizer: str | None = None) -> HFLayout

With ``hf_config`` (a checkpoint's ``config.json``: importing) the layout's
``model`` is ``model`` with the keys that ``config.json`` decides (the shape,
the kind of block) taken from it; without it (exporting) the layout's
``config`` is the ``config.json`` that describes ``model``, and its ``files``
the files of the run's ``tokenizer`` (``config.tokenizer``) to copy beside the
weights; an experiment with adapters also takes ``base=True`` (export the frozen base
alone, for the adapters' ``export --format peft``), and lists the adapters'
tensors in ``adapters``. Either way its
``tensors`` say which Hugging Face tensors each parameter is made of, and how
to turn one into the other (`HFTensor`). An unsupported checkpoint or model is
a `ConfigError` from the hook. ``experiments.lm`` has one (``experiments/lm/hf.py``).

Importing runs in three steps, each before anything is written:

* `checkpoint_model` (the CLI and the driver, before the experiment is made):
  the config's ``model`` with the checkpoint's keys on top. The checkpoint wins
  where the config says otherwise, with a line naming each key it changed. The CLI
  has it check the files too (`check_tensors`) where their weights will be read,
  before that line and before anything is written (the workdir's ``log.txt``
  included): a truncated or garbage file, a missing shard, a ``.bin`` checkpoint, a
  tensor missing or of another shape than ``config.json`` implies is one line.
* `plan`: which parameter comes from which tensors, from the files' headers only
  (`check_tensors` again); an ``init_from_skip`` that finds nothing is one
  `ConfigError` too. The console's line (`init_from.Plan.report`) says what the
  checkpoint is and what was loaded.
* `read`: each tensor read from its memory map, turned into the parameter's
  layout and put straight into the parameter's shards
  (``jax.make_array_from_callback``); a stacked ``[layers, ...]`` parameter is
  filled one layer at a time in place. The host holds one tensor (one layer's) at
  a time, never the model. The arrays take the state's dtype.

`init_from.place` then puts them into the fresh state, as for a run's checkpoint,
so ``init_from_skip``, ``freeze`` and ``lr_mults`` work on them unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from replicator import storage
from replicator.errors import ConfigError
from replicator.trainer import init_from
from replicator.trainer.safetensors_files import INDEX, SafetensorsDir

log = logging.getLogger("replicator")

PREFIX = "hf:"
LAYER = "{layer}"  # in an `HFTensor`'s names: the layer's index


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One parameter and the Hugging Face tensors it is made of.

    Attributes:
      path: the parameter's path under ``params``, ``/``-separated
        (``blocks/attention/q_kernel``).
      names: the Hugging Face tensors' names; in a stacked parameter's, ``{layer}``
        stands for the layer's index (``model.layers.{layer}.self_attn.q_proj.weight``).
      shapes: each tensor's shape, as ``config.json`` implies it.
      to_ours: ``to_ours(*tensors) -> parameter`` (one layer's, where stacked).
      to_hf: ``to_hf(parameter) -> tensors``, the inverse.
      layers: 0 for one tensor per name; else the parameter is ``[layers, ...]``,
        layer ``i`` made of the names with ``{layer}`` = i.
      also: exporting, the paths of other parameters (stacked alike) that ``to_hf``
        takes after this one, ``to_hf(parameter, *also)``: a LoRA adapter merged into its
        kernel, a quantized kernel's scales. Importing fills ``path`` alone.
    """

    path: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    to_ours: Callable[..., np.ndarray]
    to_hf: Callable[..., tuple[np.ndarray, ...]]
    layers: int = 0
    also: tuple[str, ...] = ()

    def names_of(self, layer: int | None) -> list[str]:
        """The tensors' names (of ``layer``, for a stacked parameter)."""
        return (
            [n.replace(LAYER, str(layer)) for n in self.names] if self.layers else list(self.names)
        )

    def describe(self) -> str:
        """One string for the plan's reports, e.g. ``model.layers.{0..15}.mlp.up_proj.weight``."""
        where = f"{{0..{self.layers - 1}}}"
        return " + ".join(n.replace(LAYER, where) for n in self.names)


@dataclasses.dataclass(frozen=True)
class HFLayout:
    """How a model and a Hugging Face checkpoint correspond (the hook's answer).

    Attributes:
      model: the model keys (importing: the config's, with the checkpoint's on top).
      config: the checkpoint's ``config.json`` (exporting: the one to write).
      summary: one line saying what the checkpoint is (family, layers, widths, vocab).
      tensors: every parameter the checkpoint holds, as `HFTensor`.
      prefix: the base model's prefix (``model.``, ``transformer.``): a checkpoint of
        the base model alone names its tensors without it.
      files: files an export copies beside the weights (the tokenizer's), where the
        experiment has no ``write_tokenizer`` hook (`replicator.trainer.export`).
      adapters: exporting a run with adapters (``export --format peft``), Hugging Face
        PEFT's tensors of them (``adapter_model.safetensors``' names).
      adapter_config: and PEFT's ``adapter_config.json`` but ``base_model_name_or_path``.
    """

    model: dict[str, Any]
    config: dict[str, Any]
    summary: str
    tensors: tuple[HFTensor, ...]
    prefix: str = ""
    files: tuple[str, ...] = ()
    adapters: tuple[HFTensor, ...] = ()
    adapter_config: dict[str, Any] = dataclasses.field(default_factory=dict)


def is_pretrained(spec: str | None) -> bool:
    """Whether ``config.init_from`` names a Hugging Face checkpoint (``hf:DIR``).

    >>> is_pretrained("hf:/models/llama"), is_pretrained("runs/a:200"), is_pretrained(None)
    (True, False, False)
    """
    return isinstance(spec, str) and spec.startswith(PREFIX)


def read_hf_config(spec: str) -> tuple[str, dict]:
    """``hf:DIR`` -> (DIR, its ``config.json``); a missing or unreadable one is a `ConfigError`."""
    directory = os.path.expanduser(spec[len(PREFIX) :])
    if not os.path.isdir(directory):
        raise ConfigError(f"config.init_from={spec!r}: no directory {directory}")
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            hf_config = json.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"config.init_from={spec!r}: {directory} has no config.json (a Hugging Face "
            "checkpoint's directory holds config.json and *.safetensors)"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"config.init_from={spec!r}: {path} cannot be read: {e}") from None
    if not isinstance(hf_config, dict):
        raise ConfigError(f"config.init_from={spec!r}: {path} holds no JSON object")
    return directory, hf_config


def layout(
    experiment: str, model: Mapping[str, Any], hf_config: dict | None = None, **kwargs: Any
) -> HFLayout:
    """The experiment module's ``hf_checkpoint(model, hf_config, **kwargs)``; an experiment
    without one is a `ConfigError`."""
    hook = getattr(importlib.import_module(experiment), "hf_checkpoint", None)
    if not callable(hook):
        raise ConfigError(
            f"config.experiment={experiment!r} has no hf_checkpoint(model, hf_config) hook: "
            "Hugging Face checkpoints go in and out of experiments that define one "
            "(experiments.lm)"
        )
    found = hook(dict(model), hf_config, **kwargs)
    if not isinstance(found, HFLayout):
        raise TypeError(f"{experiment}.hf_checkpoint returned {type(found).__name__}, no HFLayout")
    return found


def checkpoint_model(
    config: ml_collections.ConfigDict, *, required: bool = True, check_files: bool = False
) -> ml_collections.ConfigDict:
    """``config`` with ``config.model`` shaped as its ``hf:DIR`` checkpoint says.

    Logs one line naming the keys whose values the checkpoint changed (none when
    the config agrees, as a run's saved config does). A config without ``hf:`` is
    returned as it is, unless its ``init_from`` names a Hugging Face checkpoint's
    directory (then the error says to write ``hf:``).

    Args:
      config: a training config.
      required: False: a directory that is gone is no error (eval and export read a
        run's saved config, which holds the checkpoint's keys already).
      check_files: the weights will be read: check the files' headers against the
        layout first (`check_tensors`), before the line above is logged.

    Raises:
      ConfigError: no such directory or config.json (where ``required``), an
        experiment without the hook, a checkpoint it does not support; with
        ``check_files``, files that `check_tensors` refuses.
    """
    spec = config.get("init_from")
    if not is_pretrained(spec):
        _check_no_hf_directory(spec)
        return config
    if not required and not os.path.isdir(os.path.expanduser(spec[len(PREFIX) :])):
        return config
    if config.get("init_from_rules"):
        raise ConfigError(
            f"config.init_from_rules rename a run's checkpoint paths; config.init_from={spec!r} "
            "is mapped by the experiment itself: drop init_from_rules"
        )
    directory, hf_config = read_hf_config(spec)
    model = config.model.to_dict() if hasattr(config.model, "to_dict") else dict(config.model)
    hf = layout(config.experiment, model, hf_config)
    if check_files:
        check_tensors(spec, directory, hf)
    taken = hf.model
    changed = [
        f"{k} {model[k]!r} -> {taken[k]!r}" for k in model if model[k] != taken.get(k, model[k])
    ]
    if taken == model:
        return config
    if changed:
        log.info(
            "init_from %s: the checkpoint's config.json decides the model's shape; config.model "
            "changed: %s", spec, ", ".join(changed),
        )  # fmt: skip
    config = ml_collections.ConfigDict(config.to_dict())
    config.model = taken
    return config


def _check_no_hf_directory(spec: Any) -> None:
    """``init_from=DIR`` where DIR is a Hugging Face checkpoint's, not a run's: the
    `ConfigError` that says to write ``hf:DIR`` (else it would hold "no checkpoint")."""
    if not isinstance(spec, str) or storage.is_remote(spec):
        return
    path = os.path.expanduser(init_from.parse(spec)[0])
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "checkpoints")):
        return
    names = os.listdir(path)
    weights = [n for n in names if n.endswith((".safetensors", ".bin")) or n == INDEX]
    if "config.json" in names and weights:
        raise ConfigError(
            f"config.init_from={spec!r} is a Hugging Face checkpoint's directory (config.json, "
            f"{weights[0]}), not a run's: write --config.init_from={PREFIX}{path}"
        )


def check_tensors(spec: str, directory: str, hf: HFLayout) -> tuple[SafetensorsDir, set[str]]:
    """The checkpoint's files, with every tensor that ``hf`` names there in the shape
    ``config.json`` implies; from the files' headers only, each checked against its
    file's size (`SafetensorsDir`).

    Args:
      spec: ``config.init_from``, ``hf:DIR``, for the messages.
      directory: DIR.
      hf: the layout (`layout`) of the checkpoint's ``config.json``.

    Returns:
      The files, and the names of the tensors that the layout uses.

    Raises:
      ConfigError: no ``*.safetensors`` (a ``.bin`` checkpoint), a shard the index
        names that is not there, a file that is not a safetensors file (truncated,
        random bytes), tensors missing or of other shapes (every one listed): one line.
    """
    try:
        files = SafetensorsDir(directory)
    except ConfigError as e:
        raise ConfigError(f"config.init_from={spec!r}: {e}") from None
    used, problems = set(), []
    for tensor in hf.tensors:
        for layer in range(tensor.layers) if tensor.layers else [None]:
            for name, shape in zip(tensor.names_of(layer), tensor.shapes, strict=True):
                found = _resolve(name, files, hf.prefix)
                if found is None:
                    problems.append(f"{name} missing")
                elif files.shapes[found] != tuple(shape):
                    problems.append(f"{found} is {files.shapes[found]}, config.json says {shape}")
                else:
                    used.add(found)
    if problems:
        shown = "; ".join(problems[:8]) + (
            f"; ... ({len(problems)} in all)" if len(problems) > 8 else ""
        )
        raise ConfigError(f"config.init_from={spec!r} ({directory}): {shown}")
    return files, used


def load(
    config: ml_collections.ConfigDict, abstract_state: Any, repl, exclude: tuple[str, ...] = ()
) -> tuple:
    """``config.init_from``'s plan and arrays, for `init_from.place`: a Hugging Face
    checkpoint's (`plan`, `read`; ``config.model`` shaped by `checkpoint_model` first) or a
    run's (`init_from.plan`, `init_from.read`).

    ``exclude``: state path prefixes neither loaded nor counted (`Experiment.copies`).

    Returns:
      ``(plan, arrays)``.
    """
    if is_pretrained(config.init_from):
        the_plan, source = plan(
            config.init_from, config.experiment, config.model.to_dict(), abstract_state,
            config.init_from_skip, exclude,
        )  # fmt: skip
        return the_plan, read(the_plan, source, abstract_state)
    the_plan = init_from.plan(
        config.init_from,
        config.init_from_rules,
        abstract_state,
        repl,
        config.init_from_skip,
        exclude,
    )
    return the_plan, init_from.read(the_plan, abstract_state, repl)


@dataclasses.dataclass(frozen=True)
class Source:
    """What `read` needs beside the plan: the checkpoint's files and the layout."""

    files: SafetensorsDir
    layout: HFLayout
    tensors: dict[str, HFTensor]  # the plan's source description -> its tensor map


def plan(
    spec: str, experiment: str, model: Mapping[str, Any], abstract_state: Any,
    skip: str | None = None, exclude: tuple[str, ...] = (),
) -> tuple[init_from.Plan, Source]:  # fmt: skip
    """Matches the checkpoint's tensors to the state's parameters (headers only).

    Args:
      spec: ``config.init_from``, ``hf:DIR``.
      experiment: ``config.experiment`` (its module has the hook).
      model: ``config.model``, as `checkpoint_model` made it.
      abstract_state: the fresh state's shapes.
      skip: ``config.init_from_skip``.
      exclude: state path prefixes neither loaded nor counted (`init_from.model_paths`).

    Returns:
      The plan (``sources[state path]`` = the tensors' names), and the `Source` to read.

    Raises:
      ConfigError: what `check_tensors` refuses, a skip that finds nothing, a parameter
        the checkpoint's layout names but the model lacks.
    """
    directory, hf_config = read_hf_config(spec)
    hf = layout(experiment, model, hf_config)
    wanted = init_from.model_paths(abstract_state, exclude)
    skipped = init_from.skipped_paths(skip, wanted)
    sources, tensors = {}, {}
    for tensor in hf.tensors:
        path = state_path(tensor.path, wanted)
        if path is None:
            raise ConfigError(
                f"config.init_from={spec!r}: the model has no params/{tensor.path} for "
                f"{tensor.describe()}; a model key the checkpoint does not set changes the "
                "model's parameters (config.model: num_experts?)"
            )
        if path not in skipped:
            described = tensor.describe()
            if described in tensors:  # a second parameter of the same tensors (QLoRA's scales)
                described += f" ({tensor.path.rsplit('/', 1)[-1]})"
            sources[path] = described
            tensors[described] = tensor
    files, used = check_tensors(spec, directory, hf)
    fresh = sorted(set(wanted) - set(sources))
    unused = sorted(set(files.shapes) - used)
    the_plan = init_from.Plan(
        f"{spec} ({hf.summary})", None, sources, fresh, unused, sorted(skipped)
    )
    return the_plan, Source(files, hf, tensors)


def state_path(path: str, wanted: Mapping[str, Any]) -> str | None:
    """The state's path of parameter ``path`` (flax's boxes add ``/value``)."""
    for candidate in (f"params/{path}", f"params/{path}/value"):
        if candidate in wanted:
            return candidate
    return None


def _resolve(name: str, files: SafetensorsDir, prefix: str) -> str | None:
    """``name`` as the files spell it: as it is, or without the base model's prefix."""
    if name in files.shapes:
        return name
    if prefix and name.startswith(prefix) and name[len(prefix) :] in files.shapes:
        return name[len(prefix) :]
    return None


def read(the_plan: init_from.Plan, source: Source, abstract_state: Any) -> dict[str, jax.Array]:
    """The planned parameters, each put into its shards tensor by tensor, keyed as the
    plan's sources name them (for `init_from.place`)."""
    wanted = init_from.model_paths(abstract_state)
    arrays = {}
    for path, described in the_plan.sources.items():
        tensor, like = source.tensors[described], wanted[path]
        if tensor.layers:
            arrays[described] = _stacked(tensor, source, like)
        else:
            arrays[described] = _placed(
                _ours(tensor, source, None, like.shape, like.dtype), like.sharding
            )
    return arrays


def _ours(tensor: HFTensor, source: Source, layer: int | None, shape, dtype) -> np.ndarray:
    """One parameter (layer) in our layout and the state's dtype, on the host."""
    names = [_resolve(n, source.files, source.layout.prefix) for n in tensor.names_of(layer)]
    ours = np.asarray(tensor.to_ours(*(source.files.read(n) for n in names)), dtype)
    if ours.shape != tuple(shape):  # the hook's mapping and the model disagree: a bug
        raise RuntimeError(
            f"{tensor.describe()} made {ours.shape} for params/{tensor.path} {shape}"
        )
    return ours


def _placed(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """``host`` in ``sharding``: each device gets its slice of it, nothing more."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _stacked(tensor: HFTensor, source: Source, like: Any) -> jax.Array:
    """A ``[layers, ...]`` parameter, filled one layer at a time in its own shards."""
    sharding = like.sharding
    if not isinstance(sharding, NamedSharding):  # a layout we cannot slice: one host copy
        layers = [
            _ours(tensor, source, i, like.shape[1:], like.dtype) for i in range(tensor.layers)
        ]
        return _placed(np.stack(layers), sharding)
    spec = tuple(sharding.spec) + (None,) * (len(like.shape) - len(sharding.spec))
    layer_sharding = NamedSharding(
        sharding.mesh, PartitionSpec(*spec[1:]), memory_kind=sharding.memory_kind
    )
    stack = jax.make_array_from_callback(
        like.shape, sharding, lambda index: np.zeros(_sliced_shape(like.shape, index), like.dtype)
    )
    for i in range(tensor.layers):
        layer = _placed(_ours(tensor, source, i, like.shape[1:], like.dtype), layer_sharding)
        stack = _put_layer(stack, layer, np.int32(i))
    return stack if stack.sharding == sharding else jax.device_put(stack, sharding)


@functools.partial(jax.jit, donate_argnums=0)
def _put_layer(stack: jax.Array, layer: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(stack, layer, i, 0)


def _sliced_shape(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))
