"""What a compiled step sends between groups of devices, read from its HLO text.

A collective's replica groups say which devices it joins; a group that spans
several indices of one mesh axis sends bytes across that axis. `traffic`
counts them per device with the ring model, apart for collectives outside any
conditional (paid every step) and inside one (paid when the branch is taken,
e.g. DiLoCo's sync). The run summary reports it (`replicator.trainer.instruments`),
and `tests/test_diloco.py` checks DiLoCo's traffic with it.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np

_COLLECTIVE = re.compile(r" = (.*?) (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+))"
)


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
    position = mesh.axis_names.index(axis)
    index_of = lambda i: np.unravel_index(i, mesh.devices.shape)[position]  # noqa: E731
    branches = {
        name.strip().lstrip("%")
        for match in _BRANCHES.finditer(hlo)
        for name in (match.group(1) or match.group(2)).split(",")
    }
    totals, computation = {"every_step": 0, "in_branches": 0}, None
    for line in hlo.splitlines():
        if line.rstrip().endswith("{") and not line.startswith(" "):
            computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
        op = _COLLECTIVE.search(line)
        groups = _groups(line) if op else []
        if not any(len({index_of(i) for i in g}) > 1 for g in groups):
            continue
        g = len(groups[0])
        size = sum(
            jnp.dtype(_DTYPES.get(dtype, dtype)).itemsize
            * math.prod(int(d) for d in dims.split(",") if d)
            for dtype, dims in _ARRAY.findall(op.group(1))
        )
        if op.group(2) == "reduce-scatter":
            size *= g  # the result is one slice; the operand was g of them
        share = (2 if op.group(2) == "all-reduce" else 1) * size * (g - 1) // g
        totals["in_branches" if computation in branches else "every_step"] += share
    return totals


_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64",
           "s32": "int32", "u32": "uint32", "s8": "int8", "u8": "uint8", "pred": "bool",
           "s64": "int64", "u64": "uint64"}  # fmt: skip


def _groups(line: str) -> list[list[int]]:
    """The replica groups of one HLO collective (explicit, or iota ``[g,s]<=[dims]T(perm)``)."""
    explicit = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
    if explicit:
        return [
            [int(i) for i in g.split(",") if i]
            for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))
        ]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if not iota:
        return []
    count, size = int(iota.group(1)), int(iota.group(2))
    ids = np.arange(count * size).reshape([int(d) for d in iota.group(3).split(",")])
    if iota.group(4):
        ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
    return ids.reshape(count, size).tolist()
