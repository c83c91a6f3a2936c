"""What a compiled step computes, moves and sends, read from its HLO text.

`analyze` reads the post-optimization HLO of a step (``compiled.as_text()``, one
device's program) and counts, per device and per step:

* FLOPs of its matrix products (``dot`` and ``convolution``, Pallas kernels that
  state a cost estimate, and XLA:GPU's library calls: cuBLAS, cuDNN convolutions
  and fused attention), with every while loop's body counted as many times
  as the loop runs. XLA's ``cost_analysis()`` counts a loop's body once, so a model
  whose layers are scanned (or a step accumulating microbatches) looks 20 times
  cheaper there than it is. The trip count comes from the loop's
  ``known_trip_count`` (XLA:CPU writes it) or from its condition and body: an
  induction variable compared with a constant, starting from the constant it is
  given, stepping by what the body adds (XLA:TPU's collective matmuls step by 2).
  A conditional costs its dearest branch.
* An estimate of the HBM bytes it reads and writes: the operands and results of
  each top-level instruction (a fusion counts as one), slices of a stacked buffer
  counted as the slice, arrays XLA placed in on-chip memory (``S(1)``) not at all.
* Its collectives by kind (all-gather, reduce-scatter, all-reduce, all-to-all,
  collective-permute; async ``-start`` forms and collectives inside TPU's async
  collective fusions included), each with the bytes a device sends (ring model)
  and the mesh axes its replica groups (`replicator.compiled.replica_groups`) span, on ICI or
  across slices (DCN; on multislice TPU programs, the Megascale transfers).

`traffic` answers a narrower question used by the run summary and DiLoCo's tests:
the bytes that cross one mesh axis.

This module walks the program and tallies; reading its text is
`replicator.compiled.hlo_text`'s, the price of one instruction
`replicator.compiled.hlo_costs`'s.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

from replicator.compiled import hlo_costs, hlo_text, kernels_cost
from replicator.compiled import replica_groups as replica_groups
from replicator.compiled.hlo_text import Op, Ops, Program

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


# ---------------------------------------------------------------- the analysis


@dataclasses.dataclass(frozen=True)
class Collective:
    """Collectives of one kind over the same devices, in one step, on one device.

    Attributes:
      kind: ``"all-gather"``, ``"reduce-scatter"``, ``"all-reduce"``, ``"all-to-all"``
        or ``"collective-permute"``.
      bytes: what the device sends in them (ring model: an all-reduce of ``n`` bytes
        over ``g`` devices sends ``2n(g-1)/g``; an all-gather, reduce-scatter or
        all-to-all ``(g-1)/g`` of its larger side; a permute its operand).
      count: how many run per step (loop trip counts included).
      axes: the mesh axes their replica groups span (empty without a mesh).
      dcn: their groups span several TPU slices (or hosts): the data center network.
      in_branch: inside a conditional: paid in the steps that take the branch.
    """

    kind: str
    bytes: float
    count: int
    axes: tuple[str, ...]
    dcn: bool
    in_branch: bool = False


@dataclasses.dataclass(frozen=True)
class Analysis:
    """One device's share of one step, from its HLO (`analyze`).

    Attributes:
      flops: FLOPs of the matrix products (dot, convolution, costed kernels).
      hbm_bytes: estimated HBM bytes read and written.
      collectives: one `Collective` per kind and set of axes.
      notes: what could not be counted exactly (e.g. a loop of unknown length).
    """

    flops: float
    hbm_bytes: float
    collectives: tuple[Collective, ...]
    notes: tuple[str, ...] = ()

    def collective_bytes(self, *, dcn: bool | None = None, in_branch: bool = False) -> float:
        """Bytes a device sends per step; ``dcn``: only across slices (True) or within
        them (False); ``in_branch``: include conditional branches."""
        return sum(
            c.bytes
            for c in self.collectives
            if (dcn is None or c.dcn == dcn) and (in_branch or not c.in_branch)
        )


def analyze(hlo: str, mesh: jax.sharding.Mesh | None = None) -> Analysis:
    """FLOPs, HBM bytes and collectives of one device's program per step.

    Args:
      hlo: the post-optimization HLO text, ``jit(f).lower(...).compile().as_text()``.
      mesh: the mesh it was compiled for (logical device ``i`` is
        ``mesh.devices.flat[i]``), to name the axes collectives span and tell
        slices apart; without it, collectives are counted with no axes.

    Returns:
      An `Analysis`. Multiply ``flops`` by the number of devices for the step's total.

    >>> x = jax.ShapeDtypeStruct((8, 16), np.float32)
    >>> w = jax.ShapeDtypeStruct((4, 16, 16), np.float32)
    >>> scan = lambda x, w: jax.lax.scan(lambda c, wi: (c @ wi, None), x, w)[0]
    >>> analyze(jax.jit(scan).lower(x, w).compile().as_text()).flops == 4 * 2 * 8 * 16 * 16
    True
    """
    program = Program(hlo)
    tally = _Tally(mesh, program)
    if program.entry is not None:
        tally.walk(program.entry, 1, in_branch=False)
    return tally.result()


# ---------------------------------------------------------------- counting


class _Tally:
    """Sums of the walk: FLOPs, HBM bytes, collectives by (kind, axes, DCN, branch)."""

    def __init__(self, mesh: jax.sharding.Mesh | None, program: Program):
        self.mesh, self.program = mesh, program
        self.num_partitions = program.num_partitions
        self.num_devices = self.num_partitions or (mesh.devices.size if mesh is not None else None)
        self.flops = self.hbm = 0.0
        self.collectives: dict[tuple, list[float]] = {}
        self.notes: list[str] = []

    def walk(self, name: str, count: float, *, in_branch: bool) -> None:
        """Counts computation ``name``, run ``count`` times per step."""
        ops = self.program.computations.get(name, {})
        seen: set[tuple[str, str, str]] = set()
        for op in ops.values():
            if op.opcode == "while":
                trips = self.program.trip_count(op, ops)
                if trips is None:
                    self.note("a while loop whose trip count is not in the HLO was counted once")
                body = hlo_text.attr_name(op.attrs, "body")
                self.walk(body, count * (1 if trips is None else trips), in_branch=in_branch)
            elif op.opcode == "conditional":  # costs its dearest branch (an upper bound)
                before, costs = (self.flops, self.hbm), []
                for branch in hlo_text.branches(op.attrs):
                    self.walk(branch, count, in_branch=True)
                    costs.append((self.flops - before[0], self.hbm - before[1]))
                    self.flops, self.hbm = before
                self.flops += max((c[0] for c in costs), default=0.0)
                self.hbm += max((c[1] for c in costs), default=0.0)
            elif op.opcode == "call":
                self.walk(hlo_text.attr_name(op.attrs, "to_apply"), count, in_branch=in_branch)
            else:
                self.hbm += hlo_costs.hbm_bytes(self.program, op, ops) * count
                self.count_inside(op, ops, count, in_branch, seen)

    def count_inside(self, op: Op, ops: Ops, count, in_branch, seen, fused=False) -> None:
        """An instruction's matrix FLOPs and collectives, and those of the
        computations it fuses or wraps (a fused collective once per channel)."""
        kind = op.opcode.removesuffix("-start")
        if kind in COLLECTIVES and not (fused and _seen(op, seen)):
            self.add_collective(kind, hlo_costs.operand_bytes(op, ops), op.attrs, count, in_branch)
        elif op.opcode == "send" and "_xla_megascale_transfer_type" in op.attrs:
            size = hlo_text.type_bytes(hlo_text.type_of(ops, op.operands[0]))
            self.add_megascale(op, size, count, in_branch)
        elif op.opcode in ("dot", "convolution"):
            self.flops += hlo_costs.matmul_flops(op, ops) * count
        elif op.opcode == "custom-call":
            flops = hlo_costs.kernel_flops(op, ops)
            if flops is not None:
                self.flops += flops * count
            elif "tpu_custom_call" in op.attrs:  # splash attention: from its shapes
                counted = kernels_cost.pallas_flops(op.name, op.attrs)
                if counted is None:
                    self.note("a Pallas kernel without a cost estimate: its FLOPs are not counted")
                else:
                    self.flops += counted.flops * count
                    self.note(counted.note)
        if not op.opcode.endswith("-done"):
            inner = self.program.called(op)
            for inner_op in inner.values():
                self.count_inside(inner_op, inner, count, in_branch, seen, fused=True)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def add_collective(self, kind: str, size: float, attrs: str, count: float, branch: bool):
        groups = (
            replica_groups.of(attrs, self.num_devices)
            if kind != "collective-permute"
            else replica_groups.pairs(attrs)
        )
        if not groups:
            self.note(f"a {kind} whose replica groups could not be read: its bytes are not counted")
            return
        g = max(len(group) for group in groups)
        if g <= 1 and kind != "collective-permute":
            return
        if kind == "all-reduce":
            sent = 2 * size * (g - 1) / g
        elif kind == "all-gather":
            sent = size * (g - 1)
        elif kind == "collective-permute":
            sent = size if any(a != b for a, b in groups) else 0.0
        else:
            sent = size * (g - 1) / g
        axes, dcn = self.span(groups)
        key = (kind, axes, dcn, branch)
        entry = self.collectives.setdefault(key, [0.0, 0])
        entry[0] += sent * count
        entry[1] += count

    def add_megascale(self, op: Op, size: float, count: float, in_branch: bool) -> None:
        """A collective across TPU slices: on multislice, XLA compiles one slice's
        program and sends what crosses the data center network to the Megascale
        runtime, naming the transfer and the slices it joins."""
        kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', op.attrs).group(1)
        kind = kind.lower().replace("_", "-")
        if kind == "one-to-one":  # a ppermute's pairs ({{src->dst},...}): sends its operand
            kind, sent = "collective-permute", size
        else:
            target = re.search(r'_xla_megascale_target="\{([^}]*)\}', op.attrs)
            slices = replica_groups.count_ids(target.group(1)) if target else 0
            if slices <= 1:
                return
            factor = {"all-reduce": 2 * (slices - 1) / slices, "all-gather": slices - 1}
            sent = size * factor.get(kind, (slices - 1) / slices)
        entry = self.collectives.setdefault((kind, self.dcn_axes(), True, in_branch), [0.0, 0])
        entry[0] += sent * count
        entry[1] += count

    def dcn_axes(self) -> tuple[str, ...]:
        """The mesh axes along which the slice changes."""
        if self.mesh is None:
            return ()
        slices = np.vectorize(_granule, otypes=[int])(self.mesh.devices)
        return tuple(
            name
            for axis, name in enumerate(self.mesh.axis_names)
            if (np.diff(slices, axis=axis) != 0).any()
        )

    def span(self, groups: list[list[int]]) -> tuple[tuple[str, ...], bool]:
        """The mesh axes ``groups`` span, and whether they span slices."""
        if self.mesh is None:
            return (), False
        positions = self.positions()
        if any(i >= len(positions) for group in groups for i in group):
            return (), False
        coords = [np.array([positions[i] for i in group]) for group in groups]
        varies = np.zeros(self.mesh.devices.ndim, bool)
        for c in coords:
            varies |= (c != c[0]).any(axis=0)
        axes = tuple(name for name, v in zip(self.mesh.axis_names, varies) if v)
        devices = self.mesh.devices
        dcn = any(len({_granule(devices[tuple(positions[i])]) for i in group}) > 1
                  for group in groups)  # fmt: skip
        return axes, dcn

    def positions(self) -> list[tuple[int, ...]]:
        """Mesh coordinates of the program's logical devices: every device in mesh
        order, or on multislice (a program per slice) those of the first slice."""
        devices = self.mesh.devices
        every = list(np.ndindex(devices.shape))
        if self.num_partitions is None or self.num_partitions >= devices.size:
            return every
        first = _granule(devices.flat[0])
        return [p for p in every if _granule(devices[p]) == first]

    def result(self) -> Analysis:
        collectives = tuple(
            Collective(kind, total, int(round(n)), axes, dcn, branch)
            for (kind, axes, dcn, branch), (total, n) in sorted(self.collectives.items())
        )
        return Analysis(self.flops, self.hbm, collectives, tuple(self.notes))


def _seen(op: Op, seen: set[tuple[str, str, str]]) -> bool:
    """Whether a fused collective was counted already in this computation: TPU's async
    collective fusions repeat it (same channel, same shape) in their start and done."""
    channel = re.search(r"channel_id=(\d+)", op.attrs)
    if channel is None:
        return False
    key = (channel.group(1), op.opcode, re.sub(r"\{[^}]*\}", "", op.type))  # layouts differ
    if key in seen:
        return True
    seen.add(key)
    return False


def _granule(device) -> int:
    """The slice a device is on; off TPU, its host (process)."""
    if hasattr(device, "slice_index"):
        return device.slice_index
    return 0 if device.platform == "tpu" else device.process_index


# ---------------------------------------------------------------- traffic across one axis


def traffic(hlo: str, mesh: jax.sharding.Mesh, axis: str) -> dict[str, int]:
    """Bytes that cross ``axis`` (between its indices) in one compiled step, from its HLO.

    Args:
      hlo: ``lowered.compile().as_text()`` of the step.
      mesh: the mesh it was compiled for (logical device ``i`` is
        ``mesh.devices.flat[i]``).
      axis: the mesh axis, e.g. DiLoCo's ``"data"``.

    Returns:
      ``{"every_step": ..., "in_branches": ...}``: bytes each device sends in
      collectives whose groups span several indices of ``axis`` (ring model: an
      all-reduce of ``n`` bytes over ``g`` devices sends ``2n(g-1)/g``; an
      all-gather, all-to-all or reduce-scatter, ``(g-1)/g`` of its larger side),
      outside any conditional (paid every step) and inside one (paid when taken).

    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    >>> traffic("", mesh, "data")  # a program without collectives
    {'every_step': 0, 'in_branches': 0}
    """
    totals = {"every_step": 0, "in_branches": 0}
    for collective in analyze(hlo, mesh).collectives:
        if axis in collective.axes:
            totals["in_branches" if collective.in_branch else "every_step"] += int(collective.bytes)
    return totals
