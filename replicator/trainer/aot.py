"""``python -m replicator compile``: a run's steps compiled for a Cloud TPU slice, here.

The trainer's own `Run` (`replicator.trainer.setup`: mesh, rules, ``dcn_mesh``,
precision, accumulation, ZeRO/FSDP, remat) is built over the devices of a TPU
topology (`replicator.compiled.topology`), and its train and eval steps are lowered from
abstract inputs (`jax.ShapeDtypeStruct` with the state's and the batch's
shardings) and compiled by libtpu. Nothing is created or run: no TPU is needed.

What comes out, per chip (`CompileReport`): the compiler's memory analysis split
into parameters, optimizer state, other arguments, temporaries and generated
code, against the chip's HBM; the step's FLOPs and HBM traffic and its
collectives by kind and mesh axis, ICI or DCN (`replicator.compiled.hlo.analyze`, loop
trip counts included); and a roofline step time from the chip's published
peaks (`replicator.compiled.topology.CHIPS`). The report and the optimized HLO go to
``WORKDIR/compile[_OVERRIDES]/``.

Memory: ``total = arguments + outputs - aliased (donated) + temporaries +
generated code``, every term ``compiled.memory_analysis()``'s; parameters and
optimizer state are the per-device shard bytes of the state's ``params`` and
``opt_state`` leaves under their shardings, "other arguments" the rest of the
argument bytes (the batch, step counters, RNG keys). When XLA itself runs out of
memory compiling, the temporaries its error states plus the argument bytes are
what the step needs.

Nothing reads the data either: an example's shapes come from the dataset's
metadata (`replicator.trainer.data.metadata`; a dataset of one's own without any
is read for one example, and the report says which). Nor the weights: with
``init_from='hf:DIR'`` the model's shape comes from ``DIR/config.json`` alone (a DIR
not on this machine, such as a pod's disk, leaves ``config.model`` as it is), and
the config's tokenizer is not read (`checkpoint_shape`; the report's shapes line
says both). So a compile, and ``launch tpu``'s pre-flight that runs it, needs only
the config and the topology: no bucket, no credentials, no dataset built, no
checkpoint. (A dataset named with its own ``tokenizer=FILE`` still reads FILE: its
fingerprint names the dataset's prepared copy.)

Each compile's files go together into one folder keyed by the command line's
overrides (`report_dir`), written whole: a compile with other overrides has a
folder of its own, the same overrides replace theirs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import logging
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from replicator.compiled import hlo as hlo
from replicator.compiled import topology as topology
from replicator.errors import ConfigError, TopologyError
from replicator.parallel import diloco as diloco
from replicator.parallel import placement as placement
from replicator.trainer import data, pretrained
from replicator.trainer.compile_report import CompileReport as CompileReport
from replicator.trainer.compile_report import StepReport as StepReport
from replicator.trainer.compile_report import fit_text as fit_text
from replicator.trainer.compile_report import overrides_of as overrides_of
from replicator.trainer.compile_report import report_dir as report_dir
from replicator.trainer.compile_report import summary_lines as summary_lines
from replicator.trainer.compile_report import write_report as write_report
from replicator.trainer.data import metadata
from replicator.trainer.setup import Run, setup, sync_policy

log = logging.getLogger("replicator")

GiB = 2**30
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
STEPS = ("train", "eval", "decode")
# Seconds between the lines that say a long compile is still going.
HEARTBEAT_S = 30.0
# A test's stand-in for a far-too-large program, which libtpu can answer with SIGSEGV:
# "KEY=VALUE" makes a compile of a config whose KEY is VALUE kill itself so
# (`compile --fit` must report such a candidate and go on).
SIMULATE_SIGSEGV = "REPLICATOR_SIMULATE_SIGSEGV"


def canonical_accelerator(name: str) -> str:
    """The accelerator type as the workdir names it: lower case, and ``v5litepod-N``
    (gcloud's other name for the same slice) as ``v5e-N``.

    >>> canonical_accelerator("V5E-16"), canonical_accelerator("v5litepod-16")
    ('v5e-16', 'v5e-16')
    """
    return re.sub(r"^v5litepod-", "v5e-", topology.accelerator(name).name)


def default_workdir(config_path: str, accelerator: str, slices: int) -> str:
    """Where ``compile`` writes without ``--workdir``: ``runs/<config>_<topology>[_xN]``,
    the topology named as `canonical_accelerator` names it.

    >>> default_workdir("configs/lm_1b.py:smoke", "V5E-16", 2)
    'runs/lm_1b_smoke_v5e-16_x2'
    """
    name = re.sub(r"\.py(?=:|$)", "", config_path.rsplit("/", 1)[-1]).replace(":", "_")
    accelerator = canonical_accelerator(accelerator)
    return f"runs/{name}_{accelerator}" + (f"_x{slices}" if slices > 1 else "")


def compile_for_topology(
    config: ml_collections.ConfigDict,
    accelerator: str,
    *,
    slices: int = 1,
    workdir: str | None = None,
    overrides: dict[str, str] | None = None,
    steps: Sequence[str] = STEPS,
) -> CompileReport:
    """Compiles ``config``'s steps for ``slices`` slices of ``accelerator``.

    Args:
      config: a training config (validated by `setup`); with ``slices > 1`` and no
        ``dcn_mesh`` it gets ``dcn_mesh={"data": slices}``.
      accelerator: a gcloud accelerator type, e.g. ``"v5p-128"``.
      slices: how many such slices (multislice over the data center network).
      workdir: where the report and the HLO go (local or ``gs://``), in
        `report_dir` of ``overrides``; None writes nothing.
      overrides: the command line's ``--config.KEY=VALUE`` (already in ``config``):
        they key the report's folder and are recorded in it.
      steps: which of `STEPS` to compile; the train step always is.

    Returns:
      The `CompileReport`.

    Raises:
      TopologyError: an unknown accelerator, no libtpu, or a mesh that does not fit.
      ConfigError: any other mistake in the config.
    """
    spec = topology.accelerator(accelerator)
    topology.check_libtpu()
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        raise ConfigError(f"steps {unknown}: compile takes {', '.join(STEPS)}")
    if slices > 1 and config.dcn_mesh is None:
        with config.unlocked():
            config.dcn_mesh = {"data": slices}
        log.info("--slices %d: dcn_mesh={'data': %d} (data parallel across the slices, "
                 "config.mesh within each)", slices, slices)  # fmt: skip
    start = time.perf_counter()
    config, model_read = checkpoint_shape(config)
    shaped = example_shapes(config)
    run = _setup(config, topology.devices(spec, slices), spec, slices, shaped.example)
    try:
        mesh = dict(run.repl.mesh.shape)
        log.info(
            "compiling %s for %s: %d chips of %s (%s%s), mesh %s, step_path %r; %s",
            config.experiment, spec.name, slices * spec.chips, spec.chip.name, spec.topology,
            f" x {slices} slices" if slices > 1 else "", _axes(mesh), config.step_path,
            _shapes_line(shaped, model_read),
        )  # fmt: skip
        log.info("  the run built in %.0f s", time.perf_counter() - start)
        train, evaluate, decode, programs = _compile_steps(run, spec, steps)
    finally:
        run.close()
    train.notes.extend(run.experiment.notes)  # the experiment's own (a MoE's padding)
    report = CompileReport(
        spec.name, slices, slices * spec.chips, spec.chip.name, mesh,
        None if config.dcn_mesh is None else dict(config.dcn_mesh),
        spec.chip.usable_hbm_bytes, train, evaluate, compiler_versions(), decode,
        _shapes_line(shaped, model_read), dict(overrides or {}),
    )  # fmt: skip
    if workdir is not None:
        write_report(report, programs, report_dir(workdir, overrides))
    return report


def _compile_steps(run: Run, spec: topology.Accelerator, steps: Sequence[str]):
    """The train step, and the eval and decode steps where ``steps`` names them."""
    hbm = spec.chip.usable_hbm_bytes
    state = abstract_state(run)
    train_batch, eval_batch = abstract_batches(run)
    programs: dict[str, str] = {}
    _simulate_crash(run.config)
    train = _compile_step(
        "train", run.train_step, (state, train_batch), run, spec, hbm,
        state_bytes_per_device(state), programs,
    )  # fmt: skip
    evaluate = decode = None
    if "eval" in steps or "decode" in steps:
        eval_state = run.eval_state(state)
    if "eval" in steps:
        evaluate = _compile_step(
            "eval", run.eval_step, (eval_state, eval_batch), run, spec, hbm,
            state_bytes_per_device(eval_state), programs,
        )  # fmt: skip
    if "decode" in steps:
        decode = _compile_decode(run, spec, hbm, eval_state, programs)
    return train, evaluate, decode, programs


def example_shapes(config: ml_collections.ConfigDict) -> metadata.ShapedExample:
    """One example shaped from the config's dataset's metadata (its experiment imported
    first: that registers a builder of its own), or none, with the reason."""
    try:
        importlib.import_module(config.experiment)
    except ImportError:  # `setup` says what is wrong with it, in one line, before any data
        return metadata.ShapedExample(None, f"{config.experiment} cannot be imported")
    return metadata.example_from_metadata(config.dataset, config.data_dir)


def checkpoint_shape(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, str]:
    """``config`` with the model's shape from its ``init_from='hf:DIR'`` checkpoint's
    ``config.json`` (`pretrained.checkpoint_model`), and what the compile read for it.

    A compile reads that small file alone: never the weights, nor the config's
    tokenizer (`Settings.shapes_only`). A DIR that is not on this machine (the pod's
    disk) leaves ``config.model`` as it is, and the words say so.

    Returns:
      ``(config, words)``: the words for the report ("" without ``hf:`` or a tokenizer).
    """
    tokenizer = config.get("tokenizer")
    unread = f"; config.tokenizer={tokenizer} not read" if tokenizer not in (None, "bytes") else ""
    spec = config.get("init_from")
    if not pretrained.is_pretrained(spec):
        return config, unread.lstrip("; ")
    directory = os.path.expanduser(spec[len(pretrained.PREFIX) :])
    if not os.path.isdir(directory):
        log.warning("init_from %s: no such directory here: the model's shape is config.model's",
                    spec)  # fmt: skip
        return config, (f"init_from {spec}: not on this machine, the model's shape is "
                        f"config.model's; no weights read{unread}")  # fmt: skip
    config = pretrained.checkpoint_model(config)
    return config, (f"init_from {spec}: the model's shape from its config.json; "
                    f"no weights read{unread}")  # fmt: skip


def _shapes_line(shaped: metadata.ShapedExample, model_read: str = "") -> str:
    how = shaped.how if shaped.example is not None else (
        f"shapes from one example read from the dataset ({shaped.how})"
    )  # fmt: skip
    return f"{how}; {model_read}" if model_read else how


def _simulate_crash(config: ml_collections.ConfigDict) -> None:
    """Kills this process with SIGSEGV where `SIMULATE_SIGSEGV` names the config's value."""
    wanted = os.environ.get(SIMULATE_SIGSEGV, "")
    key, _, value = wanted.partition("=")
    if key and str(config.get(key, object())) == value:
        os.kill(os.getpid(), signal.SIGSEGV)


def _setup(config, devices, spec: topology.Accelerator, slices: int, example) -> Run:
    """The trainer's `Run` over the topology's devices (``example``, where there is one,
    standing in for the eval split); a mesh that does not fit them is a
    `TopologyError` naming the slice."""
    try:
        return setup(config, devices=devices, shapes_only=True,
                     eval_source=None if example is None else [example])  # fmt: skip
    except ConfigError as e:
        if "mesh" not in str(e).lower():
            raise
        where = f"{slices} x {spec.name}" if slices > 1 else spec.name
        raise TopologyError(f"{where} ({len(devices)} devices): {e}") from e


def _axes(sizes: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sizes.items())


def state_bytes_per_device(abstract_state: Any) -> dict[str, int]:
    """Per-device bytes of a state's parameters, optimizer state and the rest in device
    memory, and of what lives in host memory (``offload_optimizer_state``), from its
    leaves' shardings (`jax.ShapeDtypeStruct` with ``sharding``).

    >>> s = jax.ShapeDtypeStruct((4, 4), np.float32)
    >>> state_bytes_per_device({"params": {"w": s}, "opt_state": (s, s), "step": s})
    {'parameters': 64, 'optimizer_state': 128, 'other_state': 64, 'host_memory': 0}
    """
    totals = {"parameters": 0, "optimizer_state": 0, "other_state": 0, "host_memory": 0}
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        shape = getattr(leaf, "shape", None)
        if shape is None:
            continue
        sharding = getattr(leaf, "sharding", None)
        local = sharding.shard_shape(shape) if sharding is not None else shape
        size = math.prod(local) * leaf.dtype.itemsize  # a PRNG key dtype has one too
        keys = jax.tree_util.keystr(path)
        kind = "optimizer_state" if "opt_state" in keys else "other_state"
        kind = "parameters" if kind == "other_state" and "params" in keys else kind
        if "host" in str(getattr(sharding, "memory_kind", None) or ""):
            kind = "host_memory"
        totals[kind] += int(size)
    return totals


class _Shape(jax.ShapeDtypeStruct):
    """A leaf's shape whose role `run` can be told (it remembers roles by weak
    reference): a batch of one row per replica looks like a per-replica value, and
    DiLoCo's rows (one per island) like mirrored values."""

    __slots__ = ("__weakref__",)


def abstract_state(run: Run) -> Any:
    """`Run.abstract_state`, with DiLoCo's per-island rows marked as `run` marks the
    arrays it makes (`replicator.parallel.groups`)."""
    sync = sync_policy(run.config)
    if sync is None or run.repl.mesh.shape[sync.axis] == 1:
        return run.abstract_state

    def rows(tree):
        shapes = jax.tree.map(lambda x: _Shape(x.shape, x.dtype, sharding=x.sharding), tree)
        for leaf in jax.tree.leaves(shapes):
            placement.remember(leaf, placement.Kind.PER_GROUP)
        return shapes

    return diloco.map_islands(run.abstract_state, rows)


def abstract_batches(run: Run) -> tuple[dict, dict]:
    """The global train and eval batches as `jax.ShapeDtypeStruct`s split over the
    replicas, shaped like the experiment's preprocessed examples (one read from the
    eval split; the eval batch adds its ``mask``)."""
    example = run.experiment.preprocess(data.read_batch(run.eval_source, [0]))
    sharding = run.repl.batch_sharding

    def batch_of(rows: int, leaves: dict) -> dict:
        shapes = jax.tree.map(
            lambda x: _Shape((rows, *np.shape(x)[1:]), np.asarray(x).dtype,
                                  sharding=sharding),
            leaves,
        )  # fmt: skip
        for leaf in jax.tree.leaves(shapes):
            placement.remember(leaf, placement.Kind.BATCH)  # as shard_batch does
        return shapes

    masked = {**example, "mask": np.zeros((1,), np.bool_)}
    return batch_of(run.config.batch_size, example), batch_of(run.eval_batch_size, masked)


def _compile_step(
    name: str,
    step: Callable,
    args: tuple,
    run: Run,
    spec: topology.Accelerator,
    hbm: int,
    state_bytes: dict[str, int],
    programs: dict[str, str],
) -> StepReport:
    """Lowers and compiles one step, saying so as it goes; its memory, FLOPs, traffic
    and roofline."""
    start = time.perf_counter()
    try:
        with progress(f"lowering the {name} step"):
            lowered = step.lower(*args)
        with progress(f"compiling the {name} step ({spec.name}, libtpu)"):
            compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return _out_of_memory(str(e), args, state_bytes, time.perf_counter() - start)
    seconds = time.perf_counter() - start
    programs[name] = compiled.as_text()
    memory = memory_fields(compiled.memory_analysis())
    analysis = hlo.analyze(programs[name], run.repl.mesh)
    arguments = memory["argument_size_in_bytes"]
    known = state_bytes["parameters"] + state_bytes["optimizer_state"]
    breakdown = {
        "parameters": state_bytes["parameters"],
        "optimizer_state": state_bytes["optimizer_state"],
        "other_arguments": max(arguments - known, 0),
        "outputs_not_donated": memory["output_size_in_bytes"] - memory["alias_size_in_bytes"],
        "temporaries": memory["temp_size_in_bytes"],
        "generated_code": memory["generated_code_size_in_bytes"],
    }
    host = (
        memory.get("host_argument_size_in_bytes", 0) + memory.get("host_temp_size_in_bytes", 0)
        + memory.get("host_output_size_in_bytes", 0) - memory.get("host_alias_size_in_bytes", 0)
    )  # fmt: skip
    if host > 0:  # offloaded state and activations: host memory, not HBM
        breakdown["in_host_memory"] = host
    total = total_bytes(memory)
    return StepReport(
        memory, breakdown, total, total <= hbm, analysis.flops, analysis.hbm_bytes,
        [dataclasses.asdict(c) for c in analysis.collectives],
        roofline(analysis, spec.chip), seconds, list(analysis.notes),
    )  # fmt: skip


def _compile_decode(run: Run, spec, hbm: int, eval_state: Any, programs: dict) -> dict | None:
    """The experiment's one-token decode step (its ``make_sampler`` hook,
    `replicator.trainer.sample_command`) for the train batch's rows and a cache of the
    model's full context, compiled like the others, with its KV cache's bytes per chip;
    None where the experiment does not sample, ``{"skipped": why}`` where it refuses."""
    make = getattr(importlib.import_module(run.config.experiment), "make_sampler", None)
    if make is None:
        return None
    try:
        sampler = make(run.settings, tokenizer=None)
    except ConfigError as e:  # a mesh or model it does not decode (stage, context, experts)
        return {"skipped": str(e)}
    batch, slots = run.config.batch_size, sampler.max_len
    step, args = sampler.decode_program(eval_state["params"], batch, slots)
    cache = args[1].cache
    cache_bytes = sum(state_bytes_per_device((cache.k, cache.v)).values())
    report = _compile_step(
        "decode", step, args, run, spec, hbm, state_bytes_per_device(eval_state), programs
    )
    return {"batch": batch, "slots": slots, "kv_cache_bytes_per_chip": cache_bytes,
            **dataclasses.asdict(report)}  # fmt: skip


@contextlib.contextmanager
def progress(what: str, every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """Logs ``what`` as it starts, every ``every_s`` seconds while it lasts (a compile
    of a big model takes minutes on a small CPU), and its time when it is done."""
    log.info("  %s ...", what)
    start, done = time.perf_counter(), threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            log.info("  %s ... %s so far", what, _minutes(time.perf_counter() - start))

    thread = threading.Thread(target=beat, name="compile-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    log.info("  %s: done in %s", what, _minutes(time.perf_counter() - start))


def _minutes(seconds: float) -> str:
    """``"42 s"``, ``"3 min 05 s"``.

    >>> _minutes(41.6), _minutes(185)
    ('42 s', '3 min 05 s')
    """
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def memory_fields(stats: Any) -> dict[str, int]:
    """``compiled.memory_analysis()`` as a dict of its byte counts."""
    names = [n for n in dir(stats) if n.endswith("_in_bytes")]
    return {n: int(getattr(stats, n)) for n in sorted(names)}


def total_bytes(memory: dict[str, int]) -> int:
    """A step's HBM need from its memory analysis: arguments, outputs that are not
    donated arguments' buffers, temporaries and generated code."""
    return (
        memory["argument_size_in_bytes"] + memory["output_size_in_bytes"]
        - memory["alias_size_in_bytes"] + memory["temp_size_in_bytes"]
        + memory["generated_code_size_in_bytes"]
    )  # fmt: skip


def _out_of_memory(message: str, args: tuple, state_bytes: dict, seconds: float) -> StepReport:
    """The report of a step XLA could not fit: its error's temporaries plus the
    arguments' device bytes (from their shardings)."""
    in_device = state_bytes_per_device(args)
    arguments = sum(in_device.values()) - in_device["host_memory"]
    temporaries = _needed_bytes(message)
    total = arguments + (temporaries or 0)
    first = message.strip().splitlines()[0][:300]
    breakdown = {
        "parameters": state_bytes["parameters"],
        "optimizer_state": state_bytes["optimizer_state"],
        "other_arguments": max(arguments - state_bytes["parameters"] -
                               state_bytes["optimizer_state"], 0),
        "temporaries": temporaries or 0,
    }  # fmt: skip
    notes = [f"XLA ran out of memory: {first}"]
    return StepReport({}, breakdown, total, False, compile_s=seconds, notes=notes)


def _needed_bytes(message: str) -> int | None:
    """The bytes an out-of-memory error says the program needs beyond its arguments."""
    for pattern in (r"HLO temporaries \(([\d.]+)([KMGTP])\)", r"Used ([\d.]+)([KMGTP]) of"):
        match = re.search(pattern, message)
        if match:
            return int(float(match.group(1)) * _UNITS[match.group(2)])
    return None


def roofline(analysis: hlo.Analysis, chip: topology.ChipSpec) -> dict[str, Any]:
    """A lower bound on the step time per chip: the largest of its FLOPs at the peak,
    its HBM bytes at the HBM bandwidth, and the bytes its collectives send at the ICI
    (all of a chip's links busy) and DCN (the host's share per device) bandwidths;
    collectives in conditional branches left out; a term whose rate the chip table
    lacks is left out too, and named. The MFU ceiling is the compute time's share
    of it."""
    per_host = (chip.chips_per_host or 1) * chip.devices_per_chip
    dcn_rate = None if chip.dcn_bytes_per_s is None else chip.dcn_bytes_per_s / per_host
    parts = {
        "compute_s": _time(analysis.flops, chip.per_device(chip.bf16_flops_per_s)),
        "hbm_s": _time(analysis.hbm_bytes, chip.per_device(chip.hbm_bytes_per_s)),
        "ici_s": _time(analysis.collective_bytes(dcn=False), chip.per_device(chip.ici_bytes_per_s)),
        "dcn_s": _time(analysis.collective_bytes(dcn=True), dcn_rate),
    }
    known = {k: v for k, v in parts.items() if v is not None}
    unknown = [k.removesuffix("_s") for k, v in parts.items() if v is None]
    if not known:
        return {**parts, "step_s": None, "bound": None, "mfu_ceiling": None, "unknown": unknown}
    bound = max(known, key=known.get)
    step = known[bound]
    compute = parts["compute_s"]
    ceiling = compute / step if compute is not None and step > 0 else None
    return {**parts, "step_s": step, "bound": bound.removesuffix("_s"), "mfu_ceiling": ceiling,
            "unknown": unknown}  # fmt: skip


def _time(amount: float, rate: float | None) -> float | None:
    if rate is None:
        return None if amount else 0.0
    return amount / rate


def compiler_versions() -> dict[str, str]:
    """The versions of the compiler here: jax, jaxlib and libtpu (where installed)."""
    versions = {"jax": jax.__version__}
    for package in ("jaxlib", "libtpu"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions
