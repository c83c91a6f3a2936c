"""FLOPs of TPU Pallas kernels, counted from their shapes: what XLA cannot see inside.

A Mosaic kernel is one ``custom-call`` (``custom_call_target="tpu_custom_call"``)
in the compiled HLO. Its cost is the kernel author's to state, and splash
attention (``jax.experimental.pallas.ops.tpu.splash_attention``, the kernel
`replicator.attention.kernels` runs on TPU, as MaxText does) states none: a count
of the HLO's matrix products leaves attention out, 13-16% of a 1B LM's step at a
context of 2,048. `pallas_flops` counts it analytically instead.

Splash attention's three kernels are named by the phase they run: ``fwd``, ``dq``
and ``dkv`` (``splash_mha_fwd_residuals``, ``splash_mqa_dkv_segmented_no_residuals``,
...). Each works on blocks of the ``[queries, keys]`` score matrix and skips the
blocks its mask leaves empty. Replicator's mask is causal (so is MaxText's), and
under a causal mask the computed blocks are those with a key at or before some
query of the block: with queries and keys in ``n`` blocks each, ``n (n + 1) / 2`` of
``n * n`` (the diagonal blocks computed whole, masked inside). Per computed block
of ``bq`` queries and ``bk`` keys, heads of width ``d``:

* ``fwd``: ``Q K^T`` and ``P V``: ``4 bq bk d``;
* ``dq``: ``Q K^T`` again, ``dO V^T`` and ``dS K``: ``6 bq bk d``;
* ``dkv``: ``Q K^T``, ``dO V^T``, ``P^T dO`` and ``dS^T Q``: ``8 bq bk d``
  (``10``, with ``dS K`` too, where the backward pass is one fused kernel);

times the batch and heads the kernel runs over (its query operand's leading
dimensions). The shapes come from the instruction's ``operand_layout_constraints``
(the mask's block grid, then ``q``, ``k``, ``v``), the block sizes from the kernel's
metadata (splash records them) or else from the grid: ``bq = queries / blocks``.
Exponentials and the softmax's sums are not matrix FLOPs and are not counted, as
elsewhere in `replicator.compiled.hlo`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

_SPLASH = re.compile(r"splash_(mha|mqa)_(fwd|dq|dkv)(_segmented)?")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
# FLOPs per computed block, per query, key and head width (module docstring).
_PER_BLOCK = {"fwd": (2, 2), "dq": (4, 2), "dkv": (4, 4)}  # (times d_qk, times d_v)
_FUSED_DKV = (6, 4)
_BLOCK_KEYS = {
    "fwd": ("block_q", "block_kv"),
    "dq": ("block_q_dq", "block_kv_dq"),
    "dkv": ("block_q_dkv", "block_kv_dkv"),
}


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """What `pallas_flops` counted.

    Attributes:
      flops: the kernel's matrix FLOPs per call.
      kernel: its name, e.g. ``"splash_mha_fwd"``.
      blocks: the score blocks it computes (per batch row and head) and of how many.
    """

    flops: float
    kernel: str
    blocks: tuple[int, int]

    @property
    def note(self) -> str:
        """What the analysis says of it (one line per kind of kernel)."""
        return (
            "splash attention's FLOPs counted from its shapes, block-causal "
            f"({self.blocks[0]} of {self.blocks[1]} score blocks computed); the kernel "
            "states no cost of its own"
        )


def pallas_flops(name: str, attrs: str) -> KernelCost | None:
    """The FLOPs of one call of a Pallas kernel this module knows (splash attention).

    Args:
      name: the HLO instruction's name (splash's kernels are named by phase).
      attrs: its text after the operands: ``operand_layout_constraints``, and the
        kernel's metadata where the HLO's lines were joined.

    Returns:
      A `KernelCost`, or None for a kernel it does not know.

    >>> qkv = ", ".join(["bf16[2,4,2048,128]{3,2,1,0}"] * 3)
    >>> types = f"operand_layout_constraints={{s8[1,4,4]{{2,1,0}}, s8[1,4,4]{{2,1,0}}, {qkv}}}"
    >>> cost = pallas_flops("splash_mha_fwd_residuals.1", types)
    >>> cost.blocks, cost.flops == 2 * 4 * 10 * 4 * 512 * 512 * 128
    ((10, 16), True)
    """
    match = _SPLASH.search(name) or _SPLASH.search(_op_name(attrs))
    arrays = _operands(attrs)
    if match is None or arrays is None:
        return None
    phase = match.group(2)
    grid = next((dims for dtype, dims in arrays if _is_int(dtype) and len(dims) == 3), None)
    floats = [dims for dtype, dims in arrays if not _is_int(dtype) and len(dims) >= 2]
    if grid is None or len(floats) < 3:
        return None
    q, k, v = floats[:3]
    queries, keys, d_qk, d_v = q[-2], k[-2], q[-1], v[-1]
    metadata = _block_sizes(attrs)
    keys_of = _BLOCK_KEYS[phase]
    bq = metadata.get(keys_of[0]) or queries // grid[-2]
    bk = metadata.get(keys_of[1]) or keys // grid[-1]
    computed, total = causal_blocks(queries, keys, bq, bk)
    times_qk, times_v = _PER_BLOCK[phase]
    if phase == "dkv" and metadata.get("use_fused_bwd_kernel"):
        times_qk, times_v = _FUSED_DKV
    per_block = bq * bk * (times_qk * d_qk + times_v * d_v)
    flops = math.prod(q[:-2]) * computed * per_block
    return KernelCost(float(flops), match.group(0), (computed, total))


def causal_blocks(queries: int, keys: int, bq: int, bk: int) -> tuple[int, int]:
    """How many ``bq x bk`` blocks of a causal ``[queries, keys]`` mask hold an unmasked
    entry (a key at or before one of the block's queries), and of how many.

    >>> causal_blocks(2048, 2048, 512, 512), causal_blocks(2048, 2048, 512, 1024)
    ((10, 16), (6, 8))
    """
    rows, columns = -(-queries // bq), -(-keys // bk)
    offset = keys - queries  # queries at the end of the keys (a prefix of cached keys)
    computed = sum(min(columns, (min(queries, (i + 1) * bq) - 1 + offset) // bk + 1)
                   for i in range(rows))  # fmt: skip
    return computed, rows * columns


def _operands(attrs: str) -> list[tuple[str, list[int]]] | None:
    found = re.search(r"operand_layout_constraints=\{(.*?)\}(?:, [a-z_]+=|$)", attrs, re.S)
    if found is None:
        return None
    return [
        (dtype, [int(d) for d in dims.split(",") if d])
        for dtype, dims in _ARRAY.findall(found.group(1))
    ]


def _block_sizes(attrs: str) -> dict:
    """The block sizes splash records in its kernel's metadata (``xprof_metadata``)."""
    found = re.search(r'"xprof_metadata":"((?:[^"\\]|\\.)*)"', attrs)
    if found is None:
        return {}
    try:
        return json.loads(json.loads(f'"{found.group(1)}"'))
    except ValueError:
        return {}


def _op_name(attrs: str) -> str:
    found = re.search(r'op_name="([^"]*)"', attrs)
    return found.group(1) if found else ""


def _is_int(dtype: str) -> bool:
    return dtype.startswith(("s", "u", "pred"))
