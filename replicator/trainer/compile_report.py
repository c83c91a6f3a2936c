"""What ``python -m replicator compile`` reports: `CompileReport`, its folder, its lines.

A compile's files (``report.json``, each step's optimized HLO, ``log.txt``) go
together into one folder, `report_dir`: ``WORKDIR/compile`` for the config as its
file has it, ``WORKDIR/compile_<overrides>`` for a command line with
``--config.KEY=VALUE`` overrides (sorted, so their order does not matter). Each
compile writes its folder whole (`write_report` removes what an earlier compile of
the same overrides left there), so a folder never mixes two compiles, and two
compiles with different overrides keep a folder each.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

from replicator import storage
from replicator.compiled import topology as topology

GiB = 2**30
# Written by `write_report`; an earlier compile's file of these names in the folder goes.
_OWN_FILES = re.compile(r"(report\.json|log\.txt|\w+_step\.hlo\.txt)")


@dataclasses.dataclass
class StepReport:
    """One compiled step, per chip.

    Attributes:
      memory: ``memory_analysis()``'s fields in bytes (empty when XLA ran out of memory).
      breakdown: the same bytes by kind: parameters, optimizer state, other arguments,
        outputs (not donated), temporaries, generated code.
      total_bytes: the step's HBM need (`replicator.trainer.aot`'s docstring).
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
    """What ``compile`` found for one config on one topology (``report.json``).

    ``eval`` is None where only the train step was compiled (``--steps=train``);
    ``shapes`` says where the example's shapes came from (the dataset's metadata, or
    one example read); ``overrides`` are the command line's, as ``--config.KEY=VALUE``
    gives them.
    """

    topology: str
    slices: int
    chips: int
    chip: str
    mesh: dict[str, int]
    dcn_mesh: dict[str, int] | None
    hbm_per_chip_bytes: int
    train: StepReport
    eval: StepReport | None
    versions: dict[str, str]
    decode: dict[str, Any] | None = None  # `_compile_decode`'s report, where the experiment samples
    shapes: str = ""
    overrides: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """Whether every step compiled fits a chip's HBM."""
        return self.train.fits and (self.eval is None or self.eval.fits)

    def to_json(self) -> dict[str, Any]:
        """The report as ``report.json`` holds it: the train step's numbers at the top
        level (``memory_per_chip_bytes``, ``flops_per_step`` over all chips, ...)."""
        train = self.train
        flops = None if train.flops is None else train.flops * self.chips * self._per_chip
        steps = [train] if self.eval is None else [train, self.eval]
        return {
            "topology": self.topology,
            "slices": self.slices,
            "chips": self.chips,
            "chip": self.chip,
            "mesh": self.mesh,
            "dcn_mesh": self.dcn_mesh,
            "overrides": self.overrides,
            "fits": self.fits,
            "memory_per_chip_bytes": max(s.total_bytes for s in steps),
            "hbm_per_chip_bytes": self.hbm_per_chip_bytes,
            "flops_per_step": flops,
            "flops_per_step_per_chip": None if flops is None else flops / self.chips,
            "hbm_bytes_per_step_per_chip": train.hbm_bytes,
            "collectives": train.collectives,
            "roofline_step_s": train.roofline.get("step_s"),
            "mfu_ceiling": train.roofline.get("mfu_ceiling"),
            "train_step": dataclasses.asdict(train),
            "eval_step": None if self.eval is None else dataclasses.asdict(self.eval),
            "decode_step": self.decode,
            "shapes": self.shapes,
            "versions": self.versions,
        }

    @property
    def _per_chip(self) -> int:
        """JAX devices per chip (the report counts chips; TPU7x has 2 devices each)."""
        spec = topology.chip_spec(self.chip)
        return 1 if spec is None else spec.devices_per_chip


def overrides_key(overrides: dict[str, str]) -> str:
    """The overrides as a folder name's tail: sorted ``KEY=VALUE`` joined by ``,``; where
    that holds characters a path should not (or is long), a readable cut of it and a
    hash of the whole, so that two sets of overrides never share a folder.

    >>> overrides_key({"remat_policy": "minimal", "batch_size": "32"})
    'batch_size=32,remat_policy=minimal'
    >>> overrides_key({"mesh": "{'data': 1, 'fsdp': -1}"})
    'mesh=data-1,fsdp--1-ea165d05ab'
    """
    text = ",".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    if re.fullmatch(r"[\w.=,+-]{1,80}", text):
        return text
    readable = re.sub(r"-*([=,])-*", r"\1", re.sub(r"[^\w.=,+-]+", "-", text)).strip("-")
    return f"{readable[:69]}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def report_dir(workdir: str, overrides: dict[str, str] | None = None, kind: str = "compile") -> str:
    """The folder of a compile's files: ``WORKDIR/compile`` without overrides,
    ``WORKDIR/compile_<overrides_key>`` with (``fit`` for ``compile --fit``'s).

    >>> report_dir("gs://b/lm_1b"), report_dir("gs://b/lm_1b", {"remat_policy": "None"})
    ('gs://b/lm_1b/compile', 'gs://b/lm_1b/compile_remat_policy=None')
    """
    name = kind if not overrides else f"{kind}_{overrides_key(overrides)}"
    return storage.join(workdir, name)


def overrides_of(text: str) -> dict[str, str]:
    """``{KEY: VALUE}`` of the ``--config.KEY=VALUE`` words in ``text`` (the command
    line's overrides as `replicator.trainer.config_files.overrides_text` shows them).

    >>> overrides_of(" with --config.mesh={'data': 1, 'fsdp': -1} --config.remat_policy=None")
    {'mesh': "{'data': 1, 'fsdp': -1}", 'remat_policy': 'None'}
    """
    pairs = re.findall(r"--config\.([\w.]+)=(.*?)(?= --config\.|$)", text.strip(), re.S)
    return dict(pairs)


def write_report(report: CompileReport, programs: dict[str, str], directory: str) -> str:
    """Writes ``report.json`` and each step's optimized HLO (``train_step.hlo.txt``, ...)
    into ``directory``, having removed what an earlier compile wrote there (its report,
    HLO and log), so that the folder holds this compile's files only; returns the
    report's path."""
    storage.makedirs(directory)
    for name in storage.listdir(directory):
        if _OWN_FILES.fullmatch(name):
            stale = storage.join(directory, name)
            storage.call("write", stale, lambda p=stale: storage.path(p).unlink(missing_ok=True))
    for name, text in programs.items():
        storage.write_text(storage.join(directory, f"{name}_step.hlo.txt"), text)
    path = storage.join(directory, "report.json")
    storage.write_text(path, json.dumps(report.to_json(), indent=2) + "\n")
    return path


# ---------------------------------------------------------------- the console's lines


def summary_lines(report: CompileReport) -> list[str]:
    """What ``compile`` prints: per chip, each step's memory against HBM and its notes,
    the train step's FLOPs, collectives and roofline; the shapes' source and the compiler."""
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
                     f"chips); HBM traffic {size_text(train.hbm_bytes)} per step")  # fmt: skip
        lines += _collective_lines(train.collectives)
        lines += _roofline_lines(train.roofline)
    lines += _note_lines(train.notes)
    if report.eval is not None:
        lines += ["eval step, per chip:", *_memory_lines(report.eval, hbm, short=True)]
        lines += _note_lines(report.eval.notes, shown=train.notes)
    lines += _decode_lines(report.decode, hbm)
    if report.shapes:
        lines.append(report.shapes)
    lines.append(f"compiled by {compiler_text(report.versions)}")
    if not report.fits:
        lines.append(
            "to fit: shard more (mesh fsdp), remat_policy, a smaller batch per chip with "
            "grad_accum_steps, activation rules (docs/pods.md, 'When it does not fit'); "
            "or let `compile --fit` try them"
        )
    return lines


def compiler_text(versions: dict[str, str]) -> str:
    """``"jax 0.10.2, jaxlib 0.10.2, libtpu 0.0.42.1"``.

    >>> compiler_text({"jax": "0.10.2", "libtpu": "0.0.42.1"})
    'jax 0.10.2, libtpu 0.0.42.1'
    """
    return ", ".join(f"{name} {version}" for name, version in versions.items())


def _note_lines(notes: list[str], shown: list[str] = ()) -> list[str]:
    return [f"  note: {note}" for note in dict.fromkeys(notes) if note not in shown]


def _memory_lines(step: StepReport, hbm: int, short: bool = False) -> list[str]:
    rows = [f"  {k.replace('_', ' '):<21}{size_text(v):>10}" for k, v in step.breakdown.items()]
    total = f"  {'total':<21}{size_text(step.total_bytes):>10}: {fit_text(step.total_bytes, hbm)}"
    return [total] if short else [*rows, total]


def _decode_lines(decode: dict[str, Any] | None, hbm: int) -> list[str]:
    if decode is None:
        return []
    if "skipped" in decode:
        return [f"decode step: not compiled ({decode['skipped']})"]
    total = decode["total_bytes"]
    return [
        f"decode step ({decode['batch']} rows, {decode['slots']} cache slots), per chip:",
        f"  {'KV cache':<21}{size_text(decode['kv_cache_bytes_per_chip']):>10}",
        f"  {'total':<21}{size_text(total):>10}: {fit_text(total, hbm)}",
        *_note_lines(decode.get("notes", [])),
    ]


def fit_text(total: int, hbm: int) -> str:
    """``"fits, 3.1 of 15.75 GiB"`` or ``"does not fit by 87 GiB"``.

    >>> fit_text(int(3.1 * GiB), int(15.75 * GiB)), fit_text(103 * GiB, 16 * GiB)
    ('fits, 3.1 of 15.75 GiB', 'does not fit by 87 GiB (needs 103 of 16 GiB)')
    >>> fit_text(2**20, 16 * GiB)
    'fits, 1 MiB of 16 GiB'
    """
    if total <= hbm:
        used = f"{total / GiB:.3g}" if total >= GiB / 10 else size_text(total)
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
        lines.append(f"    {c['kind']:<19}over {axes:<13}{where}  {size_text(c['bytes']):>10} in "
                     f"{c['count']}{branch}")  # fmt: skip
    return lines


def _roofline_lines(parts: dict[str, Any]) -> list[str]:
    if parts.get("step_s") is None:
        return ["  roofline             unknown (no peaks for this chip)"]
    shown = ", ".join(
        f"{bound_text(k.removesuffix('_s'))} {duration_text(v)}"
        for k, v in parts.items()
        if k in ("compute_s", "hbm_s", "ici_s", "dcn_s") and v is not None
    )
    ceiling = parts["mfu_ceiling"]
    mfu = "" if ceiling is None else f"; MFU ceiling {100 * ceiling:.0f}%"
    step, bound = duration_text(parts["step_s"]), bound_text(parts["bound"])
    missing = ", ".join(bound_text(k) for k in parts.get("unknown", []))
    left_out = f"; {missing} left out: no published bandwidth" if missing else ""
    return [f"  roofline             {step} per step, bound by {bound} ({shown}){mfu}{left_out}"]


def _axes(sizes: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sizes.items())


def bound_text(name: str) -> str:
    """A roofline term's name as printed: ``compute``, ``HBM``, ``ICI``, ``DCN``."""
    return "compute" if name == "compute" else name.upper()


def duration_text(seconds: float) -> str:
    """``"362 ms"``, ``"1.2 s"``.

    >>> duration_text(0.3621), duration_text(1.2), duration_text(0)
    ('362 ms', '1.2 s', '0')
    """
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns" if seconds else "0"


def size_text(nbytes: float | None) -> str:
    """``"3.27 GiB"``, ``"613 KiB"``, ``"?"`` for None."""
    if nbytes is None:
        return "?"
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"
