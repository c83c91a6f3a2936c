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
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterator

import jax
import numpy as np

from replicator.compiled import replica_groups as replica_groups

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+))"
)


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
    program = _Program(hlo)
    tally = _Tally(mesh, program.num_partitions)
    if program.entry is not None:
        program.walk(program.entry, 1, tally, in_branch=False)
    return tally.result()


# ---------------------------------------------------------------- parsing


@dataclasses.dataclass
class _Op:
    name: str
    type: str  # the result's type text
    opcode: str
    operands: list[str]  # names of the operands
    raw: str  # the text between the opcode's parentheses
    attrs: str  # the text after them


def _parse_op(line: str) -> _Op | None:
    """One instruction line, ``[ROOT] %name = TYPE opcode(operands), attrs``."""
    match = re.match(r"\s+(?:ROOT )?%?([^\s=]+) = ", line)
    if not match:
        return None
    rest = line[match.end() :]
    if rest.startswith("("):  # a tuple type, which holds spaces and parentheses
        end = _closing(rest, 0)
        type_text, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        type_text, _, rest = rest.partition(" ")
    opcode_match = re.match(r"([\w\-]+)\(", rest)
    if not opcode_match:
        return None
    start = opcode_match.end() - 1
    end = _closing(rest, start)
    raw = rest[start + 1 : end]
    return _Op(match.group(1), type_text, opcode_match.group(1), _names(raw), raw, rest[end + 1 :])


def _names(raw: str) -> list[str]:
    """Operand names from ``%a, %b``, ``a, b`` (unoptimized HLO) or ``f32[2,3]{1,0} %a``."""
    names, depth, piece = [], 0, []
    for char in raw + ",":
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            words = re.sub(r"/\*.*?\*/", "", "".join(piece)).split()
            names += [words[-1].lstrip("%")] if words else []
            piece = []
        else:
            piece.append(char)
    return names


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


_ITEMSIZE = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
             "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
             "c128": 16}  # fmt: skip
_ARRAY_LAYOUT = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\](\{[^}]*\})?")


def _arrays(type_text: str) -> Iterator[tuple[float, bool]]:
    """``(bytes, in_hbm)`` of each array in a type; in HBM unless its layout names
    another memory space (``S(1)``: on-chip memory)."""
    for dtype, dims, layout in _ARRAY_LAYOUT.findall(type_text):
        size = math.prod(int(d) for d in dims.split(",") if d)
        itemsize = _ITEMSIZE.get(dtype, 1 if dtype.startswith("f8") else 0)
        space = re.search(r"S\((\d+)\)", layout or "")
        yield size * itemsize, space is None or space.group(1) == "0"


def _bytes(type_text: str, *, hbm_only: bool = False) -> float:
    return sum(b for b, hbm in _arrays(type_text) if hbm or not hbm_only)


def _dims(type_text: str) -> list[int]:
    match = _ARRAY.search(type_text)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


class _Program:
    """The computations of an HLO module, and the walk through what runs."""

    def __init__(self, hlo: str):
        self.computations: dict[str, dict[str, _Op]] = {}
        self.roots: dict[str, str] = {}
        self.entry: str | None = None
        partitions = re.search(r"num_partitions=(\d+)", hlo)
        self.num_partitions = int(partitions.group(1)) if partitions else None
        current = None
        for line in hlo.splitlines():
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                words = line.split()
                entry = words[0] == "ENTRY"
                current = words[1 if entry else 0].lstrip("%")
                self.computations[current] = {}
                self.entry = current if entry else self.entry
            elif current is not None and line.startswith(" "):
                op = _parse_op(line)
                if op is not None:
                    self.computations[current][op.name] = op
                    if line.lstrip().startswith("ROOT "):
                        self.roots[current] = op.name

    def walk(self, name: str, count: float, tally: _Tally, *, in_branch: bool) -> None:
        """Counts computation ``name``, run ``count`` times per step, into ``tally``."""
        ops = self.computations.get(name, {})
        seen: set[tuple[str, str, str]] = set()
        for op in ops.values():
            if op.opcode == "while":
                body = _attr_name(op.attrs, "body")
                trips = self.trip_count(op, ops, tally)
                self.walk(body, count * trips, tally, in_branch=in_branch)
            elif op.opcode == "conditional":  # costs its dearest branch (an upper bound)
                before, costs = (tally.flops, tally.hbm), []
                for branch in _branches(op.attrs):
                    self.walk(branch, count, tally, in_branch=True)
                    costs.append((tally.flops - before[0], tally.hbm - before[1]))
                    tally.flops, tally.hbm = before
                tally.flops += max((c[0] for c in costs), default=0.0)
                tally.hbm += max((c[1] for c in costs), default=0.0)
            elif op.opcode == "call":
                self.walk(_attr_name(op.attrs, "to_apply"), count, tally, in_branch=in_branch)
            else:
                tally.add_hbm(self.hbm_bytes(op, ops) * count, in_branch)
                self.count_inside(op, ops, count, tally, in_branch, seen)

    def count_inside(self, op, ops, count, tally, in_branch, seen, fused=False) -> None:
        """An instruction's matrix FLOPs and collectives, and those of the
        computations it fuses or wraps (a fused collective once per channel)."""
        kind = op.opcode.removesuffix("-start")
        if kind in COLLECTIVES and not (fused and _seen(op, seen)):
            tally.add_collective(kind, _bytes_of(op, ops), op.attrs, count, in_branch)
        elif op.opcode == "send" and "_xla_megascale_transfer_type" in op.attrs:
            tally.add_megascale(op, _bytes(_type_of(ops, op.operands[0])), count, in_branch)
        elif op.opcode in ("dot", "convolution"):
            tally.add_flops(_matmul_flops(op, ops) * count, in_branch)
        elif op.opcode == "custom-call":
            estimate = re.search(r'"cost_estimate":\s*\{[^}]*"flops":\s*"?(\d+)', op.attrs)
            library = _gpu_library_flops(op, ops)
            if estimate:
                tally.add_flops(float(estimate.group(1)) * count, in_branch)
            elif library is not None:
                tally.add_flops(library * count, in_branch)
            elif "tpu_custom_call" in op.attrs:
                tally.note("a Pallas kernel without a cost estimate: its FLOPs are not counted")
        called = _attr_name(op.attrs, "calls")
        if called and not op.opcode.endswith("-done"):
            inner = self.computations.get(called, {})
            for inner_op in inner.values():
                self.count_inside(inner_op, inner, count, tally, in_branch, seen, fused=True)

    def trip_count(self, op: _Op, ops: dict[str, _Op], tally: _Tally) -> int:
        """How many times a while loop runs: XLA's ``known_trip_count``, else read off
        its condition and body (``i < N``, ``i = init``, ``i += step``, as XLA:TPU's
        loops say it); 1, with a note, when neither says."""
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', op.attrs)
        if known:
            return int(known.group(1))
        bound = self.loop_bound(_attr_name(op.attrs, "condition"))
        if bound is not None:
            index, limit, inclusive = bound
            init = _initial_value(op, ops, index)
            step = self.loop_step(_attr_name(op.attrs, "body"), index)
            if step > 0:
                return max(-(-(limit - init + (1 if inclusive else 0)) // step), 0)
        tally.note("a while loop whose trip count is not in the HLO was counted once")
        return 1

    def scalar_op(self, ops: dict[str, _Op], name: str) -> tuple[_Op | None, list]:
        """The op computing ``name`` and its operands resolved (`_resolve`), through the
        fusion XLA:CPU wraps a loop's compare or increment in."""
        op = ops.get(name)
        while op is not None and op.opcode in ("copy", "bitcast") and op.operands:
            op = ops.get(op.operands[0])
        if op is None:
            return None, []
        operands = [_resolve(ops, n) for n in op.operands]
        if op.opcode != "fusion":
            return op, operands
        fused = _attr_name(op.attrs, "calls")
        inner = self.computations.get(fused, {})
        root = inner.get(self.roots.get(fused, ""))
        if root is None:
            return None, []
        params = {o.name: int(o.raw) for o in inner.values() if o.opcode == "parameter"}
        resolved = [
            operands[params[n]] if n in params else _resolve(inner, n) for n in root.operands
        ]
        return root, resolved

    def loop_bound(self, condition: str | None) -> tuple[int, int, bool] | None:
        """``(tuple index of the induction variable, limit, inclusive)`` of a loop
        condition comparing a tuple element with a constant (directly or fused)."""
        ops = self.computations.get(condition or "", {})
        root, operands = self.scalar_op(ops, self.roots.get(condition or "", ""))
        direction = re.search(r"direction=(\w+)", root.attrs) if root is not None else None
        if root is None or root.opcode != "compare" or not direction or len(operands) != 2:
            return None
        (left_kind, left), (right_kind, right) = operands
        flipped = {"GT": "LT", "GE": "LE"}
        if left_kind == "gte" and right_kind == "const" and direction.group(1) in ("LT", "LE"):
            return left, right, direction.group(1) == "LE"
        if left_kind == "const" and right_kind == "gte" and direction.group(1) in flipped:
            return right, left, flipped[direction.group(1)] == "LE"
        return None

    def loop_step(self, body: str | None, index: int) -> int:
        """What a loop's body adds to tuple element ``index`` each trip (1 when it does
        not say: the loops XLA makes from ``scan`` and ``fori_loop`` count by one)."""
        ops = self.computations.get(body or "", {})
        root = ops.get(self.roots.get(body or "", ""))
        if root is None or root.opcode != "tuple" or index >= len(root.operands):
            return 1
        op, operands = self.scalar_op(ops, root.operands[index])
        if op is None or op.opcode != "add" or len(operands) != 2:
            return 1
        kinds = dict(operands)
        return kinds["const"] if kinds.get("gte") == index and "const" in kinds else 1

    def hbm_bytes(self, op: _Op, ops: dict[str, _Op]) -> float:
        """HBM bytes one run of a top-level instruction reads and writes (see module doc)."""
        if op.opcode in _NO_TRAFFIC or op.opcode.endswith("-done"):
            return 0.0
        if op.opcode == "custom-call" and "AllocateBuffer" in op.attrs:
            return 0.0
        if op.opcode == "dynamic-slice":
            return 2 * _bytes(op.type, hbm_only=True)
        if op.opcode == "dynamic-update-slice" and len(op.operands) > 1:
            return 2 * _bytes(_type_of(ops, op.operands[1]), hbm_only=True)
        inputs = [_bytes(_type_of(ops, name), hbm_only=True) for name in op.operands]
        output = _bytes(op.type, hbm_only=True)
        if op.opcode == "fusion":
            inputs, output = self.fusion_traffic(op, inputs, output)
        return sum(inputs) + output

    def fusion_traffic(self, op: _Op, inputs: list[float], output: float):
        """A fusion's inputs and output, where it slices a stacked buffer (a scanned
        layer's weights) or updates one in place, counted as the slice."""
        fused = _attr_name(op.attrs, "calls")
        inner = self.computations.get(fused, {})
        params = {o.name: int(o.raw) for o in inner.values() if o.opcode == "parameter"}
        uses = collections.defaultdict(list)
        for inner_op in inner.values():
            for position, name in enumerate(inner_op.operands):
                uses[name].append((inner_op, position))
        for name, index in params.items():
            if index >= len(inputs) or not uses[name]:
                continue
            if all(o.opcode == "dynamic-slice" and p == 0 for o, p in uses[name]):
                inputs[index] = sum(_bytes(o.type, hbm_only=True) for o, _ in uses[name])
            elif all(o.opcode == "dynamic-update-slice" and p == 0 for o, p in uses[name]):
                inputs[index] = 0.0  # updated in place: only the update is written
                for update, _ in uses[name]:
                    written = _bytes(_type_of(inner, update.operands[1]))
                    output -= _bytes(update.type) - written
        return inputs, max(output, 0.0)


_NO_TRAFFIC = frozenset(
    {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
     "partition-id", "replica-id", "opt-barrier", "add-dependency", "iota"}
)  # fmt: skip


def _type_of(ops: dict[str, _Op], name: str) -> str:
    op = ops.get(name)
    return op.type if op is not None else ""


def _attr_name(attrs: str, key: str) -> str | None:
    match = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
    return match.group(1) if match else None


def _branches(attrs: str) -> list[str]:
    return [
        name.strip().lstrip("%")
        for match in _BRANCHES.finditer(attrs)
        for name in (match.group(1) or match.group(2)).split(",")
        if name.strip()
    ]


def _seen(op: _Op, seen: set[tuple[str, str, str]]) -> bool:
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


def _resolve(ops: dict[str, _Op], name: str) -> tuple[str, int] | tuple[None, None]:
    """``("const", value)``, ``("gte", tuple index)`` or ``(None, None)`` for a scalar,
    through copies and conversions."""
    op = ops.get(name)
    while op is not None and op.opcode in ("copy", "convert", "bitcast") and op.operands:
        op = ops.get(op.operands[0])
    if op is None:
        return None, None
    if op.opcode == "constant" and re.fullmatch(r"-?\d+", op.raw.strip()):
        return "const", int(op.raw.strip())
    index = re.search(r"index=(\d+)", op.attrs)
    if op.opcode == "get-tuple-element" and index:
        return "gte", int(index.group(1))
    return None, None


def _initial_value(loop: _Op, ops: dict[str, _Op], index: int) -> int:
    """The induction variable's value entering ``loop`` (0 when not a constant)."""
    init = ops.get(loop.operands[0]) if loop.operands else None
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return 0
    kind, value = _resolve(ops, init.operands[index])
    return value if kind == "const" else 0


def _matmul_flops(op: _Op, ops: dict[str, _Op]) -> float:
    """2 x the multiply-adds of a dot or a convolution."""
    if len(op.operands) < 2:
        return 0.0
    if op.opcode == "convolution":
        return _convolution_flops(op, ops)
    lhs = _dims(_type_of(ops, op.operands[0]))
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", op.attrs)
    dims = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
    return 2.0 * math.prod(_dims(op.type)) * math.prod(lhs[d] for d in dims if d < len(lhs))


def _gpu_library_flops(op: _Op, ops: dict[str, _Op]) -> float | None:
    """2 x the multiply-adds of a matrix product XLA:GPU hands to a library, or None for
    any other custom call: cuBLAS GEMMs (``__cublas$gemm``, ``__cublas$lt$matmul``),
    cuDNN convolutions (forward and both backward kinds) and cuDNN's fused attention
    (``__cudnn$fmha``: its two products forward, five backward, flash attention
    recomputing the scores; counted whole, causal or not, as the MFU formula does)."""
    target = re.search(r'custom_call_target="([^"]+)"', op.attrs)
    target = target.group(1) if target else ""
    if len(op.operands) < 2 or not target.startswith(("__cublas$", "__cudnn$")):
        return None
    shapes = [_dims(_type_of(ops, name)) for name in op.operands]
    if target.startswith("__cublas$"):
        contracting = _dimension_list(op.attrs, "lhs_contracting_dimensions")
        lhs = shapes[0]
        return (
            2.0 * math.prod(_dims(op.type)) * math.prod(lhs[d] for d in contracting if d < len(lhs))
        )
    if target.startswith("__cudnn$fmha"):
        # Q.K^T forward; backward, dO.V^T: the product of the same shapes (q and k's).
        key = "bmm2_grad_gemm2" if "Backward" in target else "bmm1"
        block = re.search(rf'"{key}_dot_dimension_numbers":\s*(\{{[^}}]*\}})', op.attrs)
        if block is None:
            return None
        q, k = shapes[0], shapes[1]
        batch = _dimension_list(block.group(1), "lhs_batch_dimensions")
        contracting = _dimension_list(block.group(1), "lhs_contracting_dimensions")
        rhs_batch = _dimension_list(block.group(1), "rhs_batch_dimensions")
        rhs_contracting = _dimension_list(block.group(1), "rhs_contracting_dimensions")
        if max(batch + contracting, default=0) >= len(q) or max(
            rhs_batch + rhs_contracting, default=0
        ) >= len(k):
            return None
        queries = math.prod(n for d, n in enumerate(q) if d not in batch + contracting)
        keys = math.prod(n for d, n in enumerate(k) if d not in rhs_batch + rhs_contracting)
        one = 2.0 * math.prod(q[d] for d in batch) * queries * keys * math.prod(
            q[d] for d in contracting)  # fmt: skip
        return one * (5 if "Backward" in target else 2)
    kinds = {  # where a convolution's input, filter and output are, as the forward's
        "__cudnn$convForward": ("operand0", "operand1", "result"),
        "__cudnn$convBiasActivationForward": ("operand0", "operand1", "result"),
        "__cudnn$convBackwardInput": ("result", "operand1", "operand0"),
        "__cudnn$convBackwardFilter": ("operand0", "result", "operand1"),
    }
    if target not in kinds:
        return None
    pick = lambda where: _dims(op.type) if where == "result" else shapes[int(where[-1])]
    return _convolution_shapes_flops(op.attrs, *(pick(w) for w in kinds[target]))


def _dimension_list(text: str, key: str) -> list[int]:
    """``"key":["1","2"]`` (or unquoted numbers) in a backend config, as ints."""
    match = re.search(rf'"{key}":\s*\[([^\]]*)\]', text)
    return [int(d) for d in re.findall(r"\d+", match.group(1))] if match else []


def _convolution_flops(op: _Op, ops: dict[str, _Op]) -> float:
    """A convolution's multiply-adds that touch input, not padding: per spatial dimension
    the (output, window) position pairs that land on an input element. (XLA:TPU writes
    some dots as convolutions whose windows mostly cover padding.)"""
    lhs, rhs, out = (_dims(_type_of(ops, op.operands[0])), _dims(_type_of(ops, op.operands[1])),
                     _dims(op.type))  # fmt: skip
    return _convolution_shapes_flops(op.attrs, lhs, rhs, out)


def _convolution_shapes_flops(attrs: str, lhs: list[int], rhs: list[int], out: list[int]) -> float:
    """`_convolution_flops` of an input, filter and output shape and the op's attributes."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs)
    if not labels or [len(x) for x in labels.groups()] != [len(lhs), len(rhs), len(out)]:
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    window = re.search(r"window=\{([^}]*)\}", attrs)
    fields = dict(f.split("=", 1) for f in window.group(1).split()) if window else {}
    spatial = sorted(c for c in out_labels if c.isdigit())
    per_dim = {  # a window field per spatial dimension, e.g. stride=2x2, pad=1_1x1_1
        key: fields[key].split("x") if key in fields else [default] * len(spatial)
        for key, default in (("stride", "1"), ("pad", "0_0"), ("lhs_dilate", "1"),
                             ("rhs_dilate", "1"))
    }  # fmt: skip
    pairs = 1
    for d, label in enumerate(spatial):
        pairs *= _valid_pairs(
            lhs[lhs_labels.index(label)], rhs[rhs_labels.index(label)],
            out[out_labels.index(label)], int(per_dim["stride"][d]),
            int(per_dim["pad"][d].split("_")[0]), int(per_dim["lhs_dilate"][d]),
            int(per_dim["rhs_dilate"][d]),
        )  # fmt: skip
    batch, features = out[out_labels.index("b")], out[out_labels.index("f")]
    return 2.0 * batch * features * rhs[rhs_labels.index("i")] * pairs


def _valid_pairs(size, window, outputs, stride, pad_low, lhs_dilate, rhs_dilate) -> int:
    """(output, window) positions along one dimension that read an input element."""
    last = (size - 1) * lhs_dilate
    count = 0
    for o in range(outputs):
        for k in range(window):
            p = o * stride + k * rhs_dilate - pad_low
            count += 0 <= p <= last and p % lhs_dilate == 0
    return count


def _bytes_of(op: _Op, ops: dict[str, _Op]) -> float:
    """The bytes a collective's operands hold (all memory spaces)."""
    return sum(_bytes(_type_of(ops, name)) for name in op.operands)


# ---------------------------------------------------------------- counting


class _Tally:
    """Sums of the walk: FLOPs, HBM bytes, collectives by (kind, axes, DCN, branch)."""

    def __init__(self, mesh: jax.sharding.Mesh | None, num_partitions: int | None):
        self.mesh, self.num_partitions = mesh, num_partitions
        self.num_devices = num_partitions or (mesh.devices.size if mesh is not None else None)
        self.flops = self.hbm = 0.0
        self.collectives: dict[tuple, list[float]] = {}
        self.notes: list[str] = []

    def add_flops(self, flops: float, in_branch: bool) -> None:
        del in_branch  # a conditional's branches are weighed where it is walked
        self.flops += flops

    def add_hbm(self, nbytes: float, in_branch: bool) -> None:
        del in_branch
        self.hbm += nbytes

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

    def add_megascale(self, op: _Op, size: float, count: float, in_branch: bool) -> None:
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
