"""Reading post-optimization HLO text: its instructions, its computations, and how many
times a while loop runs.

This is the reading half of `replicator.compiled.hlo`, which counts what a step
computes, moves and sends; `replicator.compiled.hlo_costs` prices one instruction.
An instruction line reads ``[ROOT] %name = TYPE opcode(operands), attrs``; a
computation is a block of them under its name (``ENTRY`` marks the program's).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_ARRAY_LAYOUT = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\](\{[^}]*\})?")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+))"
)
_ITEMSIZE = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
             "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
             "c128": 16}  # fmt: skip


@dataclasses.dataclass
class Op:
    """One HLO instruction.

    Attributes:
      name: its name, without ``%``.
      type: the result's type text, e.g. ``f32[8,16]{1,0}``.
      opcode: e.g. ``dot``, ``fusion``, ``all-reduce-start``.
      operands: the names of its operands.
      raw: the text between the opcode's parentheses.
      attrs: the text after them.
    """

    name: str
    type: str
    opcode: str
    operands: list[str]
    raw: str
    attrs: str


Ops = dict[str, Op]  # one computation's instructions by name


def parse_op(line: str) -> Op | None:
    """One instruction line as an `Op`.

    Args:
      line: an indented line of HLO text, ``[ROOT] %name = TYPE opcode(operands), attrs``.

    Returns:
      The `Op`, or None for a line that is not an instruction.

    >>> op = parse_op("  %d = f32[8,16]{1,0} dot(f32[8,4]{1,0} %a, %b), lhs_contracting_dims={1}")
    >>> op.opcode, op.operands, op.attrs
    ('dot', ['a', 'b'], ', lhs_contracting_dims={1}')
    """
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
    return Op(match.group(1), type_text, opcode_match.group(1), _names(raw), raw, rest[end + 1 :])


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


def _arrays(type_text: str) -> Iterator[tuple[float, bool]]:
    """``(bytes, in_hbm)`` of each array in a type; in HBM unless its layout names
    another memory space (``S(1)``: on-chip memory)."""
    for dtype, dims, layout in _ARRAY_LAYOUT.findall(type_text):
        size = math.prod(int(d) for d in dims.split(",") if d)
        itemsize = _ITEMSIZE.get(dtype, 1 if dtype.startswith("f8") else 0)
        space = re.search(r"S\((\d+)\)", layout or "")
        yield size * itemsize, space is None or space.group(1) == "0"


def type_bytes(type_text: str, *, hbm_only: bool = False) -> float:
    """The bytes of the arrays in a type (a tuple's summed).

    Args:
      type_text: an `Op`'s type, e.g. ``(f32[8]{0}, bf16[2,4]{1,0:S(1)})``.
      hbm_only: leave out arrays placed in another memory space (``S(1)``).

    Returns:
      The bytes.

    >>> type_bytes("(f32[8]{0}, bf16[2,4]{1,0:S(1)})"), type_bytes("f32[8]{0:S(1)}", hbm_only=True)
    (48, 0)
    """
    return sum(b for b, hbm in _arrays(type_text) if hbm or not hbm_only)


def dims(type_text: str) -> list[int]:
    """The dimensions of the first array in a type (``[]`` for a scalar or none)."""
    match = _ARRAY.search(type_text)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def type_of(ops: Ops, name: str) -> str:
    """The type of instruction ``name`` of ``ops`` (empty when there is none)."""
    op = ops.get(name)
    return op.type if op is not None else ""


def attr_name(attrs: str, key: str) -> str | None:
    """The computation an attribute names, e.g. ``body=%while_body.2`` -> ``while_body.2``."""
    match = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
    return match.group(1) if match else None


def branches(attrs: str) -> list[str]:
    """The branch computations of a ``conditional``."""
    return [
        name.strip().lstrip("%")
        for match in _BRANCHES.finditer(attrs)
        for name in (match.group(1) or match.group(2)).split(",")
        if name.strip()
    ]


class Program:
    """The computations of an HLO module, and the trip counts of its loops.

    Attributes:
      computations: each computation's instructions, by name.
      roots: each computation's root instruction.
      entry: the entry computation (None in text without one).
      num_partitions: the module's ``num_partitions`` (None when it does not say).
    """

    def __init__(self, hlo: str):
        self.computations: dict[str, Ops] = {}
        self.roots: dict[str, str] = {}
        self.entry: str | None = None
        partitions = re.search(r"num_partitions=(\d+)", hlo)
        self.num_partitions = int(partitions.group(1)) if partitions else None
        current, op = None, None
        for line in hlo.splitlines():
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                words = line.split()
                entry = words[0] == "ENTRY"
                current, op = words[1 if entry else 0].lstrip("%"), None
                self.computations[current] = {}
                self.entry = current if entry else self.entry
            elif current is not None and line.startswith(" "):
                op = parse_op(line)
                if op is not None:
                    self.computations[current][op.name] = op
                    if line.lstrip().startswith("ROOT "):
                        self.roots[current] = op.name
            elif op is not None and line and line != "}":
                op.attrs += "\n" + line  # attributes over several lines (a kernel's metadata)

    def called(self, op: Op, key: str = "calls") -> Ops:
        """The instructions of the computation ``op`` names by ``key`` (a fusion's)."""
        return self.computations.get(attr_name(op.attrs, key) or "", {})

    def trip_count(self, op: Op, ops: Ops) -> int | None:
        """How many times a while loop runs: XLA's ``known_trip_count``, else read off
        its condition and body (``i < N``, ``i = init``, ``i += step``, as XLA:TPU's
        loops say it); None when neither says."""
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', op.attrs)
        if known:
            return int(known.group(1))
        bound = self._loop_bound(attr_name(op.attrs, "condition"))
        if bound is not None:
            index, limit, inclusive = bound
            init = _initial_value(op, ops, index)
            step = self._loop_step(attr_name(op.attrs, "body"), index)
            if step > 0:
                return max(-(-(limit - init + (1 if inclusive else 0)) // step), 0)
        return None

    def _scalar_op(self, ops: Ops, name: str) -> tuple[Op | None, list]:
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
        fused = attr_name(op.attrs, "calls")
        inner = self.computations.get(fused, {})
        root = inner.get(self.roots.get(fused, ""))
        if root is None:
            return None, []
        params = {o.name: int(o.raw) for o in inner.values() if o.opcode == "parameter"}
        resolved = [
            operands[params[n]] if n in params else _resolve(inner, n) for n in root.operands
        ]
        return root, resolved

    def _loop_bound(self, condition: str | None) -> tuple[int, int, bool] | None:
        """``(tuple index of the induction variable, limit, inclusive)`` of a loop
        condition comparing a tuple element with a constant (directly or fused)."""
        ops = self.computations.get(condition or "", {})
        root, operands = self._scalar_op(ops, self.roots.get(condition or "", ""))
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

    def _loop_step(self, body: str | None, index: int) -> int:
        """What a loop's body adds to tuple element ``index`` each trip (1 when it does
        not say: the loops XLA makes from ``scan`` and ``fori_loop`` count by one)."""
        ops = self.computations.get(body or "", {})
        root = ops.get(self.roots.get(body or "", ""))
        if root is None or root.opcode != "tuple" or index >= len(root.operands):
            return 1
        op, operands = self._scalar_op(ops, root.operands[index])
        if op is None or op.opcode != "add" or len(operands) != 2:
            return 1
        kinds = dict(operands)
        return kinds["const"] if kinds.get("gte") == index and "const" in kinds else 1


def _resolve(ops: Ops, name: str) -> tuple[str, int] | tuple[None, None]:
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


def _initial_value(loop: Op, ops: Ops, index: int) -> int:
    """The induction variable's value entering ``loop`` (0 when not a constant)."""
    init = ops.get(loop.operands[0]) if loop.operands else None
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return 0
    kind, value = _resolve(ops, init.operands[index])
    return value if kind == "const" else 0
