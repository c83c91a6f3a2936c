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
``WORKDIR/compile/``.

Memory: ``total = arguments + outputs - aliased (donated) + temporaries +
generated code``, every term ``compiled.memory_analysis()``'s; parameters and
optimizer state are the per-device shard bytes of the state's ``params`` and
``opt_state`` leaves under their shardings, "other arguments" the rest of the
argument bytes (the batch, step counters, RNG keys). When XLA itself runs out of
memory compiling, the temporaries its error states plus the argument bytes are
what the step needs.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import math
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np

from replicator import storage
from replicator.compiled import hlo as hlo
from replicator.compiled import topology as topology
from replicator.errors import ConfigError, TopologyError
from replicator.parallel import diloco as diloco
from replicator.parallel import placement as placement
from replicator.trainer import data
from replicator.trainer.setup import Run, setup, sync_policy

log = logging.getLogger("replicator")

GiB = 2**30
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}


@dataclasses.dataclass
class StepReport:
    """One compiled step, per chip.

    Attributes:
      memory: ``memory_analysis()``'s fields in bytes (empty when XLA ran out of memory).
      breakdown: the same bytes by kind: parameters, optimizer state, other arguments,
        outputs (not donated), temporaries, generated code.
      total_bytes: the step's HBM need (see the module's docstring).
      fits: whether it fits one chip's HBM.
      flops: FLOPs per chip per step (`replicator.compiled.hlo.analyze`; None without a program).
      hbm_bytes: HBM bytes read and written per chip per step (estimate).
      collectives: one dict per `replicator.compiled.hlo.Collective`.
      roofline: seconds per step bound by compute, HBM, ICI and DCN, their max and
        the bound's name, and the MFU ceiling that implies.
      compile_s: seconds to lower and compile.
      notes: what was estimated or left out.
    """

    memory: dict[str, int]
    breakdown: dict[str, int]
    total_bytes: int
    fits: bool
    flops: float | None = None
    hbm_bytes: float | None = None
    collectives: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    roofline: dict[str, Any] = dataclasses.field(default_factory=dict)
    compile_s: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CompileReport:
    """What ``compile`` found for one config on one topology (``report.json``)."""

    topology: str
    slices: int
    chips: int
    chip: str
    mesh: dict[str, int]
    dcn_mesh: dict[str, int] | None
    hbm_per_chip_bytes: int
    train: StepReport
    eval: StepReport
    versions: dict[str, str]
    decode: dict[str, Any] | None = None  # `_compile_decode`'s report, where the experiment samples

    @property
    def fits(self) -> bool:
        """Whether both steps fit a chip's HBM."""
        return self.train.fits and self.eval.fits

    def to_json(self) -> dict[str, Any]:
        """The report as ``report.json`` holds it: the train step's numbers at the top
        level (``memory_per_chip_bytes``, ``flops_per_step`` over all chips, ...)."""
        train = self.train
        flops = None if train.flops is None else train.flops * self.chips * self._per_chip
        return {
            "topology": self.topology,
            "slices": self.slices,
            "chips": self.chips,
            "chip": self.chip,
            "mesh": self.mesh,
            "dcn_mesh": self.dcn_mesh,
            "fits": self.fits,
            "memory_per_chip_bytes": max(train.total_bytes, self.eval.total_bytes),
            "hbm_per_chip_bytes": self.hbm_per_chip_bytes,
            "flops_per_step": flops,
            "flops_per_step_per_chip": None if flops is None else flops / self.chips,
            "hbm_bytes_per_step_per_chip": train.hbm_bytes,
            "collectives": train.collectives,
            "roofline_step_s": train.roofline.get("step_s"),
            "mfu_ceiling": train.roofline.get("mfu_ceiling"),
            "train_step": dataclasses.asdict(train),
            "eval_step": dataclasses.asdict(self.eval),
            "decode_step": self.decode,
            "versions": self.versions,
        }

    @property
    def _per_chip(self) -> int:
        """JAX devices per chip (the report counts chips; TPU7x has 2 devices each)."""
        spec = topology.chip_spec(self.chip)
        return 1 if spec is None else spec.devices_per_chip


def default_workdir(config_path: str, accelerator: str, slices: int) -> str:
    """Where ``compile`` writes without ``--workdir``: ``runs/<config>_<topology>[_xN]``.

    >>> default_workdir("configs/lm_1b.py:smoke", "v5e-16", 2)
    'runs/lm_1b_smoke_v5e-16_x2'
    """
    name = re.sub(r"\.py(?=:|$)", "", config_path.rsplit("/", 1)[-1]).replace(":", "_")
    return f"runs/{name}_{accelerator}" + (f"_x{slices}" if slices > 1 else "")


def compile_for_topology(
    config: ml_collections.ConfigDict,
    accelerator: str,
    *,
    slices: int = 1,
    workdir: str | None = None,
) -> CompileReport:
    """Compiles ``config``'s train and eval steps for ``slices`` slices of ``accelerator``.

    Args:
      config: a training config (validated by `setup`); with ``slices > 1`` and no
        ``dcn_mesh`` it gets ``dcn_mesh={"data": slices}``.
      accelerator: a gcloud accelerator type, e.g. ``"v5p-128"``.
      slices: how many such slices (multislice over the data center network).
      workdir: where ``compile/report.json`` and the HLO go (local or ``gs://``);
        None writes nothing.

    Returns:
      The `CompileReport`.

    Raises:
      TopologyError: an unknown accelerator, no libtpu, or a mesh that does not fit.
      ConfigError: any other mistake in the config.
    """
    spec = topology.accelerator(accelerator)
    topology.check_libtpu()
    if slices > 1 and config.dcn_mesh is None:
        with config.unlocked():
            config.dcn_mesh = {"data": slices}
        log.info("--slices %d: dcn_mesh={'data': %d} (data parallel across the slices, "
                 "config.mesh within each)", slices, slices)  # fmt: skip
    run = _setup(config, topology.devices(spec, slices), spec, slices)
    try:
        mesh = dict(run.repl.mesh.shape)
        log.info(
            "compiling %s for %s: %d chips of %s (%s%s), mesh %s, step_path %r",
            config.experiment, spec.name, slices * spec.chips, spec.chip.name, spec.topology,
            f" x {slices} slices" if slices > 1 else "", _axes(mesh), config.step_path,
        )  # fmt: skip
        hbm = spec.chip.usable_hbm_bytes
        state = abstract_state(run)
        state_bytes = state_bytes_per_device(state)
        train_batch, eval_batch = abstract_batches(run)
        eval_state = run.eval_state(state)
        programs = {}
        train = _compile_step(
            "train", run.train_step, (state, train_batch), run, spec, hbm, state_bytes, programs
        )
        evaluate = _compile_step(
            "eval", run.eval_step, (eval_state, eval_batch), run, spec, hbm,
            state_bytes_per_device(eval_state), programs,
        )  # fmt: skip
        decode = _compile_decode(run, spec, hbm, eval_state, programs)
    finally:
        run.close()
    report = CompileReport(
        spec.name, slices, slices * spec.chips, spec.chip.name, mesh,
        None if config.dcn_mesh is None else dict(config.dcn_mesh), hbm, train, evaluate,
        _versions(), decode,
    )  # fmt: skip
    if workdir is not None:
        write_report(report, programs, workdir)
    return report


def _setup(config, devices, spec: topology.Accelerator, slices: int) -> Run:
    """The trainer's `Run` over the topology's devices; a mesh that does not fit them
    is a `TopologyError` naming the slice."""
    try:
        return setup(config, devices=devices)
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
    """Lowers and compiles one step; its memory, FLOPs, traffic and roofline."""
    start = time.perf_counter()
    try:
        compiled = step.lower(*args).compile()
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


def _versions() -> dict[str, str]:
    versions = {"jax": jax.__version__}
    for package in ("jaxlib", "libtpu"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def write_report(report: CompileReport, programs: dict[str, str], workdir: str) -> str:
    """Writes ``WORKDIR/compile/report.json`` and each step's optimized HLO beside it
    (``train_step.hlo.txt``, ``eval_step.hlo.txt``); returns the report's path."""
    directory = storage.join(workdir, "compile")
    storage.makedirs(directory)
    for name, text in programs.items():
        storage.write_text(storage.join(directory, f"{name}_step.hlo.txt"), text)
    path = storage.join(directory, "report.json")
    storage.write_text(path, json.dumps(report.to_json(), indent=2) + "\n")
    return path


# ---------------------------------------------------------------- the console's lines


def summary_lines(report: CompileReport) -> list[str]:
    """What ``compile`` prints: per chip, each step's memory against HBM, then the train
    step's FLOPs, collectives and roofline."""
    hbm, train = report.hbm_per_chip_bytes, report.train
    slices = f" x {report.slices} slices" if report.slices > 1 else ""
    dcn = f", dcn_mesh {_axes(report.dcn_mesh)}" if report.dcn_mesh else ""
    lines = [
        f"{report.topology}{slices}: {report.chips} chips of {report.chip}, "
        f"{hbm / GiB:.4g} GiB of HBM each; mesh {_axes(report.mesh)}{dcn}",
        "train step, per chip:",
        *_memory_lines(train, hbm),
    ]
    if train.flops is not None:
        every = report.to_json()["flops_per_step"]
        lines.append(f"  FLOPs                {train.flops:.3g} per step ({every:.3g} on all "
                     f"chips); HBM traffic {_size(train.hbm_bytes)} per step")  # fmt: skip
        lines += _collective_lines(train.collectives)
        lines += _roofline_lines(train.roofline)
    lines += ["eval step, per chip:", *_memory_lines(report.eval, hbm, short=True)]
    lines += _decode_lines(report.decode, hbm)
    lines += [f"  note: {note}" for note in dict.fromkeys(train.notes + report.eval.notes)]
    if not report.fits:
        lines.append(
            "to fit: shard more (mesh fsdp), remat_policy, a smaller batch per chip with "
            "grad_accum_steps, activation rules (docs/pods.md, 'When it does not fit')"
        )
    return lines


def _memory_lines(step: StepReport, hbm: int, short: bool = False) -> list[str]:
    rows = [f"  {k.replace('_', ' '):<21}{_size(v):>10}" for k, v in step.breakdown.items()]
    total = f"  {'total':<21}{_size(step.total_bytes):>10}: {fit_text(step.total_bytes, hbm)}"
    return [total] if short else [*rows, total]


def _decode_lines(decode: dict[str, Any] | None, hbm: int) -> list[str]:
    if decode is None:
        return []
    if "skipped" in decode:
        return [f"decode step: not compiled ({decode['skipped']})"]
    total = decode["total_bytes"]
    return [
        f"decode step ({decode['batch']} rows, {decode['slots']} cache slots), per chip:",
        f"  {'KV cache':<21}{_size(decode['kv_cache_bytes_per_chip']):>10}",
        f"  {'total':<21}{_size(total):>10}: {fit_text(total, hbm)}",
    ]


def fit_text(total: int, hbm: int) -> str:
    """``"fits, 3.1 of 15.75 GiB"`` or ``"does not fit by 87 GiB"``.

    >>> fit_text(int(3.1 * GiB), int(15.75 * GiB)), fit_text(103 * GiB, 16 * GiB)
    ('fits, 3.1 of 15.75 GiB', 'does not fit by 87 GiB (needs 103 of 16 GiB)')
    >>> fit_text(2**20, 16 * GiB)
    'fits, 1 MiB of 16 GiB'
    """
    if total <= hbm:
        used = f"{total / GiB:.3g}" if total >= GiB / 10 else _size(total)
        return f"fits, {used} of {hbm / GiB:.4g} GiB"
    return (
        f"does not fit by {(total - hbm) / GiB:.3g} GiB "
        f"(needs {total / GiB:.4g} of {hbm / GiB:.4g} GiB)"
    )


def _collective_lines(collectives: list[dict[str, Any]]) -> list[str]:
    if not collectives:
        return ["  collectives          none"]
    lines = ["  collectives          bytes each chip sends per step (ring model):"]
    for c in collectives:
        axes = ",".join(c["axes"]) or "?"
        where = "DCN" if c["dcn"] else "ICI"
        branch = ", in a conditional branch" if c["in_branch"] else ""
        lines.append(f"    {c['kind']:<19}over {axes:<13}{where}  {_size(c['bytes']):>10} in "
                     f"{c['count']}{branch}")  # fmt: skip
    return lines


def _roofline_lines(parts: dict[str, Any]) -> list[str]:
    if parts.get("step_s") is None:
        return ["  roofline             unknown (no peaks for this chip)"]
    shown = ", ".join(
        f"{_bound(k.removesuffix('_s'))} {_duration(v)}"
        for k, v in parts.items()
        if k in ("compute_s", "hbm_s", "ici_s", "dcn_s") and v is not None
    )
    ceiling = parts["mfu_ceiling"]
    mfu = "" if ceiling is None else f"; MFU ceiling {100 * ceiling:.0f}%"
    step, bound = _duration(parts["step_s"]), _bound(parts["bound"])
    missing = ", ".join(_bound(k) for k in parts.get("unknown", []))
    left_out = f"; {missing} left out: no published bandwidth" if missing else ""
    return [f"  roofline             {step} per step, bound by {bound} ({shown}){mfu}{left_out}"]


def _bound(name: str) -> str:
    return "compute" if name == "compute" else name.upper()


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns" if seconds else "0"


def _size(nbytes: float | None) -> str:
    if nbytes is None:
        return "?"
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"
