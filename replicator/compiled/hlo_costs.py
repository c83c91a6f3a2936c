"""What one HLO instruction costs: the FLOPs of its matrix products and the HBM bytes
it reads and writes.

`replicator.compiled.hlo` walks a step's program and multiplies these by how many
times each instruction runs; `replicator.compiled.hlo_text` reads the instructions.
"""

from __future__ import annotations

import collections
import math
import re

from replicator.compiled.hlo_text import Op, Ops, Program, dims, type_bytes, type_of

_NO_TRAFFIC = frozenset(
    {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
     "partition-id", "replica-id", "opt-barrier", "add-dependency", "iota"}
)  # fmt: skip


# ---------------------------------------------------------------- FLOPs


def matmul_flops(op: Op, ops: Ops) -> float:
    """2 x the multiply-adds of a ``dot`` or a ``convolution``.

    Args:
      op: the instruction.
      ops: the instructions of its computation (for its operands' shapes).

    Returns:
      The FLOPs of one run of ``op``.
    """
    if len(op.operands) < 2:
        return 0.0
    if op.opcode == "convolution":
        return _convolution_flops(op, ops)
    lhs = dims(type_of(ops, op.operands[0]))
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", op.attrs)
    axes = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
    return 2.0 * math.prod(dims(op.type)) * math.prod(lhs[d] for d in axes if d < len(lhs))


def kernel_flops(op: Op, ops: Ops) -> float | None:
    """The FLOPs of a ``custom-call``: a Pallas kernel's own cost estimate, or a matrix
    product XLA:GPU hands to a library (`_gpu_library_flops`); None when it says none."""
    estimate = re.search(r'"cost_estimate":\s*\{[^}]*"flops":\s*"?(\d+)', op.attrs)
    if estimate:
        return float(estimate.group(1))
    return _gpu_library_flops(op, ops)


def _gpu_library_flops(op: Op, ops: Ops) -> float | None:
    """2 x the multiply-adds of a matrix product XLA:GPU hands to a library, or None for
    any other custom call: cuBLAS GEMMs (``__cublas$gemm``, ``__cublas$lt$matmul``),
    cuDNN convolutions (forward and both backward kinds) and cuDNN's fused attention
    (``__cudnn$fmha``: its two products forward, five backward, flash attention
    recomputing the scores; counted whole, causal or not, as the MFU formula does)."""
    target = re.search(r'custom_call_target="([^"]+)"', op.attrs)
    target = target.group(1) if target else ""
    if len(op.operands) < 2 or not target.startswith(("__cublas$", "__cudnn$")):
        return None
    shapes = [dims(type_of(ops, name)) for name in op.operands]
    if target.startswith("__cublas$"):
        contracting = _dimension_list(op.attrs, "lhs_contracting_dimensions")
        lhs = shapes[0]
        return (
            2.0 * math.prod(dims(op.type)) * math.prod(lhs[d] for d in contracting if d < len(lhs))
        )
    if target.startswith("__cudnn$fmha"):
        return _attention_flops(op, target, shapes[0], shapes[1])
    kinds = {  # where a convolution's input, filter and output are, as the forward's
        "__cudnn$convForward": ("operand0", "operand1", "result"),
        "__cudnn$convBiasActivationForward": ("operand0", "operand1", "result"),
        "__cudnn$convBackwardInput": ("result", "operand1", "operand0"),
        "__cudnn$convBackwardFilter": ("operand0", "result", "operand1"),
    }
    if target not in kinds:
        return None
    pick = lambda where: dims(op.type) if where == "result" else shapes[int(where[-1])]
    return _convolution_shapes_flops(op.attrs, *(pick(w) for w in kinds[target]))


def _attention_flops(op: Op, target: str, q: list[int], k: list[int]) -> float | None:
    """cuDNN's fused attention: Q.K^T forward; backward, dO.V^T, the product of the same
    shapes (q and k's)."""
    key = "bmm2_grad_gemm2" if "Backward" in target else "bmm1"
    block = re.search(rf'"{key}_dot_dimension_numbers":\s*(\{{[^}}]*\}})', op.attrs)
    if block is None:
        return None
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


def _dimension_list(text: str, key: str) -> list[int]:
    """``"key":["1","2"]`` (or unquoted numbers) in a backend config, as ints."""
    match = re.search(rf'"{key}":\s*\[([^\]]*)\]', text)
    return [int(d) for d in re.findall(r"\d+", match.group(1))] if match else []


def _convolution_flops(op: Op, ops: Ops) -> float:
    """A convolution's multiply-adds that touch input, not padding: per spatial dimension
    the (output, window) position pairs that land on an input element. (XLA:TPU writes
    some dots as convolutions whose windows mostly cover padding.)"""
    lhs, rhs, out = (dims(type_of(ops, op.operands[0])), dims(type_of(ops, op.operands[1])),
                     dims(op.type))  # fmt: skip
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


# ---------------------------------------------------------------- bytes


def operand_bytes(op: Op, ops: Ops) -> float:
    """The bytes ``op``'s operands hold (all memory spaces): what a collective moves."""
    return sum(type_bytes(type_of(ops, name)) for name in op.operands)


def hbm_bytes(program: Program, op: Op, ops: Ops) -> float:
    """The HBM bytes one run of a top-level instruction reads and writes.

    Its operands and results (a fusion counts as one instruction), slices of a stacked
    buffer counted as the slice, arrays XLA placed in on-chip memory (``S(1)``) not at all.

    Args:
      program: the program ``op`` is in (for what a fusion computes).
      op: the instruction, of ``ops``.
      ops: the instructions of its computation.

    Returns:
      The bytes.
    """
    if op.opcode in _NO_TRAFFIC or op.opcode.endswith("-done"):
        return 0.0
    if op.opcode == "custom-call" and "AllocateBuffer" in op.attrs:
        return 0.0
    if op.opcode == "dynamic-slice":
        return 2 * type_bytes(op.type, hbm_only=True)
    if op.opcode == "dynamic-update-slice" and len(op.operands) > 1:
        return 2 * type_bytes(type_of(ops, op.operands[1]), hbm_only=True)
    inputs = [type_bytes(type_of(ops, name), hbm_only=True) for name in op.operands]
    output = type_bytes(op.type, hbm_only=True)
    if op.opcode == "fusion":
        inputs, output = _fusion_traffic(program.called(op), inputs, output)
    return sum(inputs) + output


def _fusion_traffic(inner: Ops, inputs: list[float], output: float):
    """A fusion's inputs and output, where it slices a stacked buffer (a scanned
    layer's weights) or updates one in place, counted as the slice."""
    params = {o.name: int(o.raw) for o in inner.values() if o.opcode == "parameter"}
    uses = collections.defaultdict(list)
    for inner_op in inner.values():
        for position, name in enumerate(inner_op.operands):
            uses[name].append((inner_op, position))
    for name, index in params.items():
        if index >= len(inputs) or not uses[name]:
            continue
        if all(o.opcode == "dynamic-slice" and p == 0 for o, p in uses[name]):
            inputs[index] = sum(type_bytes(o.type, hbm_only=True) for o, _ in uses[name])
        elif all(o.opcode == "dynamic-update-slice" and p == 0 for o, p in uses[name]):
            inputs[index] = 0.0  # updated in place: only the update is written
            for update, _ in uses[name]:
                written = type_bytes(type_of(inner, update.operands[1]))
                output -= type_bytes(update.type) - written
    return inputs, max(output, 0.0)
