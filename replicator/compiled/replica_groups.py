"""Replica groups of HLO collectives: which devices each collective joins.

XLA writes them three ways, all read here: explicit lists (``{{0,1},{2,3}}``), iota
lists (``[2,2]<=[4]``, ``[4,2]<=[2,4]T(1,0)``), and, in newer XLA, a mesh with the axes
the groups span (``mesh['x'=4,'y'=2], device_ids=([2,4]T(1,0)) {'x'}``, sub-axes as
``'x':(1)2``). A collective-permute names source -> target pairs instead
(`pairs`), and on multislice TPU programs the Megascale runtime's transfers name the
slices they join (`count_ids`). Ids are the program's logical devices
(`replicator.compiled.hlo`).

>>> of("replica_groups={{0,1},{2,3}}, dimensions={0}")
[[0, 1], [2, 3]]
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Sequence

import numpy as np


def of(line: str, num_devices: int | None = None) -> list[list[int]]:
    """The replica groups of one HLO collective: explicit (``{{0,1},{2,3}}``), iota
    (``[g,s]<=[dims]T(perm)``), or a mesh's axes (``mesh[...] {axes}``); ``{}`` is
    every device (when ``num_devices`` is known)."""
    if "replica_groups=mesh[" in line:
        return _mesh_groups(line)
    explicit = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
    if explicit:
        return [
            [int(i) for i in g.split(",") if i]
            for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))
        ]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        count, size = int(iota.group(1)), int(iota.group(2))
        ids = np.arange(count * size).reshape([int(d) for d in iota.group(3).split(",")])
        if iota.group(4):
            ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
        return ids.reshape(count, size).tolist()
    if re.search(r"replica_groups=\{\}", line) and num_devices:
        return [list(range(num_devices))]
    return []


def _mesh_groups(line: str) -> list[list[int]]:
    """Groups written as a mesh and the axes they span, e.g.
    ``mesh['x'=4,'y'=2], device_ids=([2,4]T(1,0)) {'x'}`` or ``{'x':(1)2}`` (a sub-axis:
    the size-2 part after a part of size 1)."""
    start = line.index("replica_groups=mesh[") + len("replica_groups=mesh[")
    end = line.index("]", start)
    axes = [(n.strip().strip("'\""), int(s)) for n, s in
            (a.rsplit("=", 1) for a in line[start:end].split(",") if "=" in a)]  # fmt: skip
    sizes = [s for _, s in axes]
    rest = line[end + 1 :]
    ids = np.arange(math.prod(sizes))
    listed = re.match(r", device_ids=\(([^()]*(?:\([^()]*\))?)\)", rest)
    if listed:
        ids = _device_ids(listed.group(1), math.prod(sizes))
        rest = rest[listed.end() :]
        if ids is None:
            return []
    refs = re.match(r"\s*\{([^}]*)\}", rest)
    if refs is None:
        return []
    names = [n for n, _ in axes]
    split: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for ref in (r.strip() for r in refs.group(1).split(",") if r.strip()):
        sub = re.fullmatch(r"['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?", ref)
        if sub is None or sub.group(1) not in names:
            return []
        axis = names.index(sub.group(1))
        pre, size = (int(sub.group(2)), int(sub.group(3))) if sub.group(2) else (1, sizes[axis])
        split[axis].append((pre, size))
    return _grouped(ids.reshape(sizes), sizes, split)


def _device_ids(text: str, count: int) -> np.ndarray | None:
    iota = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
    if iota:
        ids = np.arange(count).reshape([int(d) for d in iota.group(1).split(",")])
        if iota.group(2):
            ids = ids.transpose([int(p) for p in iota.group(2).split(",")])
        return ids.reshape(-1)
    values = [int(v) for v in re.findall(r"\d+", text.split("]", 1)[-1])]
    return np.array(values) if len(values) == count else None


def _grouped(array: np.ndarray, sizes: Sequence[int], split) -> list[list[int]]:
    """The devices of ``array`` grouped along the (sub-)axes in ``split``."""
    dims, grouped = [], []
    for axis, size in enumerate(sizes):
        parts = sorted(split.get(axis, []))
        if not parts:
            dims.append(size)
            continue
        covered = 1
        for pre, part in parts:
            if pre > covered:
                dims.append(pre // covered)
                covered = pre
            grouped.append(len(dims))
            dims.append(part)
            covered *= part
        if covered < size:
            dims.append(size // covered)
    if math.prod(dims) != array.size:
        return []
    kept = [d for d in range(len(dims)) if d not in grouped]
    group_size = math.prod(dims[d] for d in grouped)
    moved = array.reshape(dims).transpose(kept + grouped)
    return moved.reshape(-1, group_size).tolist()


def count_ids(text: str) -> int:
    """How many ids a list like ``1,2`` or ``0:15`` names."""
    count = 0
    for item in (i.strip() for i in text.split(",") if i.strip()):
        low, _, high = item.partition(":")
        count += int(high) - int(low) + 1 if high else 1
    return count


def pairs(line: str) -> list[list[int]]:
    """A collective-permute's source -> target pairs, as two-device groups."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if not pairs:
        return []
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(1) + "}")]
