"""Inputs: host data to global arrays on the mesh, and a thread that does it ahead.

Each process passes its own rows of a global batch (`process_rows`);
`shard_batch` assembles them into global arrays split over the replicas,
`replicate` places a value mirrored on every device, and `Prefetcher` runs
`shard_batch` a few batches ahead in a background thread (`distribute`).
"""

from __future__ import annotations

import collections
import math
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from replicator.parallel.placement import Kind, Roles, remember
from replicator.spmd import graphs as graphs

PyTree = Any


def feeding_processes(roles: Roles) -> int:
    """Into how many parts the processes split a batch: the process count under data
    parallelism, 1 where every process holds every replica's rows."""
    rows = collections.defaultdict(set)
    num_replicas = roles.num_replicas
    for device, index in roles.batch_sharding.devices_indices_map((num_replicas,)).items():
        rows[device.process_index].add(index[0].indices(num_replicas)[:2])
    return len({frozenset(r) for r in rows.values()})


def shard_batch(host_batch: PyTree, roles: Roles, feeders: int) -> PyTree:
    """`Replicator.shard_batch`: ``host_batch`` (this process's rows) as global arrays."""
    leaves = jax.tree.leaves(host_batch)
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if None in sizes or len(sizes) != 1:
        shapes = jax.tree.map(np.shape, host_batch)
        raise ValueError(
            "shard_batch needs every leaf to have the same leading (batch) size; "
            f"got shapes {shapes}."
        )
    (local_size,) = sizes
    global_size, num_replicas = local_size * feeders, roles.num_replicas
    if global_size % num_replicas:
        raise ValueError(
            f"Global batch of {global_size} examples ({local_size} per process x "
            f"{feeders} process{'es' * (feeders != 1)}) does not split over {num_replicas} "
            f"replicas; use a batch size that is a multiple of {num_replicas}, or "
            "pad the batch and pass a mask as sample_weight."
        )
    sharding = roles.batch_sharding
    batch = jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), host_batch
    )
    if global_size == num_replicas:
        # One example per replica looks like a per-replica value: remember it is not.
        for x in jax.tree.leaves(batch):
            remember(x, Kind.BATCH)
    return batch


def process_rows(global_batch_size: int, roles: Roles, feeders: int) -> slice:
    """`Replicator.process_rows`: this process's rows of each global batch."""
    num_replicas = roles.num_replicas
    for count, one, many in (
        (feeders, "process", "processes"),
        (num_replicas, "replica", "replicas"),
    ):
        if global_batch_size <= 0 or global_batch_size % count:
            raise ValueError(
                f"A global batch of {global_batch_size} rows does not split evenly over "
                f"{count} {one if count == 1 else many}; use a multiple of "
                f"{math.lcm(feeders, num_replicas)}."
            )
    indices = roles.batch_sharding.addressable_devices_indices_map((global_batch_size,))
    rows = sorted({idx[0].indices(global_batch_size)[:2] for idx in indices.values()})
    start, stop = rows[0][0], rows[-1][1]
    if sum(b - a for a, b in rows) != stop - start:
        raise ValueError(
            f"Process {jax.process_index()} holds rows {rows} of the batch, which are "
            "not contiguous; build the Replicator with devices ordered by process."
        )
    return slice(start, stop)


def replicate(tree: PyTree, mirrored: NamedSharding) -> PyTree:
    """`Replicator.replicate`: ``tree`` mirrored on every device, in buffers of its own."""
    if graphs.contains_graph_nodes(tree):
        call = graphs.split_call((tree,))
        placed = replicate(call.args, mirrored)
        (tree,), _ = graphs.merge_call(call.layout, placed)
        return tree

    def place(x):
        if isinstance(x, jax.Array) and x.is_fully_addressable and jax.process_count() == 1:
            placed = jax.device_put(x, mirrored, may_alias=False)
            # may_alias=False is not enough: broadcasting to several devices, JAX reuses
            # x's buffer on the device x is on. Donating the result would delete x.
            return jnp.copy(placed) if _shares_buffers(placed, x) else placed
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            # Typed PRNG keys have no NumPy form: place their raw data, re-wrap.
            data = place(jax.random.key_data(x))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.make_array_from_process_local_data(mirrored, np.asarray(x))

    return jax.tree.map(place, tree)


def _shares_buffers(a: jax.Array, b: jax.Array) -> bool:
    """Whether ``a`` holds any of ``b``'s device buffers (True when it cannot tell)."""
    try:
        theirs = {s.data.unsafe_buffer_pointer() for s in b.addressable_shards}
        return any(s.data.unsafe_buffer_pointer() in theirs for s in a.addressable_shards)
    except Exception:  # a backend without buffer pointers: assume the worst, copy
        return True


class Prefetcher:
    """Runs ``transform`` over an iterator in a background thread, ``size`` items ahead."""

    _DONE = object()

    def __init__(self, source: Iterator, transform: Callable, size: int):
        self._source = source
        self._state = source.get_state() if hasattr(source, "get_state") else None
        self._queue: queue.Queue = queue.Queue(maxsize=max(size, 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(transform,), daemon=True)
        self._thread.start()

    def _fill(self, transform: Callable) -> None:
        stateful = self._state is not None
        try:
            for item in self._source:
                state = self._source.get_state() if stateful else None
                if not self._put((transform(item), state)):
                    return
            self._put(self._DONE)
        except BaseException as e:  # handed to the consumer, which re-raises it
            self._put(_Failure(e))

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self):
        item = self._queue.get()
        if item is self._DONE:
            self._queue.put(item)  # stay exhausted
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.error
        item, self._state = item
        return item

    def get_state(self):
        """The source's state after the last returned item."""
        if self._state is None:
            raise TypeError(f"{type(self._source).__name__} has no get_state().")
        return self._state

    def close(self) -> None:
        """Stops the background thread and waits for it, so nothing runs at exit."""
        self._stop.set()
        self._thread.join(timeout=60)

    def __del__(self):
        self._stop.set()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error
