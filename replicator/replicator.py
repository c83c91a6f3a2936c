"""The Replicator: one mesh, and the two ways of running a step function on it.

* `Replicator.run` is the per-replica path (TF-Replicator's ``repl.run``,
  tf.distribute's ``strategy.run``), built on `jax.shard_map`: each replica sees
  its own shard of the batch and a mirrored copy of everything else.
* `Replicator.compile` is the global-view path (pjit): `jax.jit` over the same
  mesh, the compiler inserts the collectives.

Both share the same input placement (`shard_batch`, `distribute`, `replicate`),
the same optimizer wrapper and a bound on the steps in flight.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import itertools
import math
import queue
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from replicator import cpu, diloco, graphs, optim, sharding, zero
from replicator import per_replica as pr
from replicator.context import (
    AxisNameError,
    ReplicaContext,
    get_replica_context,
    global_view,
    in_global_view,
    island_axis,
    island_view,
    replica_context,
    vary,
    varying_axes,
)
from replicator.mesh import DATA_AXES, build_mesh
from replicator.per_replica import Kind, PerReplica
from replicator.precision import Policy, apply_policy, expect_policy, get_policy
from replicator.runtime import compat

PyTree = Any


class ReduceOp(enum.Enum):
    """How `Replicator.reduce` combines per-replica values."""

    SUM = "sum"
    MEAN = "mean"


class Replicator:
    """Runs single-device step functions as one SPMD program over a device mesh.

    Args:
      devices: the devices to use; ``None`` means every device of every process.
      mesh: axis sizes for ``"data"``, ``"fsdp"`` and ``"tensor"`` (``-1`` = the
        rest); ``None`` means pure data parallelism over all ``devices``.
      precision: ``None``/``"fp32"``, ``"bf16"``, ``"fp16"`` or a `Policy`: what
        `apply_policy` applies to a model and `TrainState.create` to a state
        (fp16 adds a dynamic loss scale); the trainer uses both.
      max_steps_in_flight: how many dispatched steps may be unfinished when
        `run` or a compiled step returns. ``None``: 2 on a mesh of several CPU
        devices (an unbounded queue of sharded steps has deadlocked XLA:CPU's
        all-reduce rendezvous), no bound elsewhere (GPUs and TPUs queue work on
        their streams; a bound would only make the host wait).
      cpu_defaults: on a CPU mesh, apply `replicator.cpu.configure`: a faster
        lowering of max pooling (process-wide, bitwise-identical results),
        convolutions on Eigen instead of YNNPACK, and with several devices per
        process XLA's memory-optimized scheduler and glibc keeping freed memory
        (process-wide). 3-6x faster training of the tutorial CNN on CPU; False
        keeps JAX's defaults.
      rules: how parameters shard: ``(logical_axis, mesh_axis)`` pairs for flax
        logical-axis annotations, or ``(path_regex, (mesh_axis, ...))`` for
        models without them; None: `replicator.sharding.DEFAULT_RULES` (FSDP on
        ``fsdp``, Megatron-style ``mlp``/``heads`` on ``tensor``). See
        `param_shardings`.
      strict: a rule that matches nothing, or a large parameter left replicated
        on a sharded mesh, is an error instead of a warning.
      dcn_mesh: axis sizes across TPU slices (or hosts), e.g. ``{"data": 2}``;
        ``mesh`` then gives the sizes within one slice, and each axis spans
        both (`replicator.mesh.hybrid_mesh_devices`): keep ``fsdp`` and
        ``tensor`` inside slices, ``data`` (one all-reduce a step) across.

    Attributes:
      mesh: the `jax.sharding.Mesh`, axes ``("data", "fsdp", "tensor")``.
      axis_name: the mesh axes the replicas span, e.g. ``("data",)`` or
        ``("data", "fsdp")`` (those of size > 1; ``("data",)`` on one device):
        the one name to pass to ``lax.psum``/``pmean``/``axis_index`` and
        ``nn.BatchNorm(axis_name=...)``, valid under `run` and `compile`.
      num_replicas: how many replicas `run` runs (the size of ``axis_name``).
      precision: the `Policy`.
      batch_sharding: how `shard_batch` splits a batch over the replicas.
      mirrored_sharding: a value mirrored on every device.

    Example::

      repl = rp.Replicator()
      tx = repl.wrap_optimizer(optax.sgd(0.1))
      state = repl.replicate((params, tx.init(params)))
      for host_batch in batches:
          state, loss = repl.run(train_step, state, repl.shard_batch(host_batch))
    """

    def __init__(
        self,
        devices: Sequence[jax.Device] | None = None,
        mesh: Mapping[str, int] | None = None,
        precision: str | Policy | None = None,
        *,
        max_steps_in_flight: int | None = None,
        cpu_defaults: bool = True,
        rules: Sequence[sharding.Rule] | None = None,
        strict: bool = False,
        dcn_mesh: Mapping[str, int] | None = None,
    ):
        if max_steps_in_flight is not None and max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1, got {max_steps_in_flight}.")
        self.mesh = build_mesh(devices, mesh, dcn_mesh)
        self.precision = get_policy(precision)
        # Only axes of size > 1: a value split over them varies exactly there.
        self.axis_name: tuple[str, ...] = (
            tuple(a for a in DATA_AXES if self.mesh.shape[a] > 1) or DATA_AXES[:1]
        )
        self.num_replicas: int = math.prod(self.mesh.shape[a] for a in DATA_AXES)
        # What compile binds to its one replica: the replica axes, and the data axes
        # of size 1 too, which run's replicas also accept (a collective over them
        # is the identity): one step, both paths.
        self._one_replica_axes = self.axis_name + tuple(
            a for a in DATA_AXES if a not in self.axis_name
        )
        # Spelled ("data", "fsdp") even where one has size 1: a parameter sharded
        # over "fsdp" alone is then never mistaken for a batch.
        self.batch_sharding = NamedSharding(self.mesh, P(DATA_AXES))
        self.mirrored_sharding = NamedSharding(self.mesh, P())
        self._feeders = _feeding_processes(self.batch_sharding, self.num_replicas)
        devices = list(self.mesh.devices.flat)
        self._device_set = set(devices)  # what NNX objects' arrays must sit on
        if max_steps_in_flight is None:  # only XLA:CPU's collectives need a bound
            max_steps_in_flight = 2 if cpu.needs_bounded_dispatch(devices) else 0
        self._in_flight = _StepsInFlight(max_steps_in_flight)
        self._compiler_options = cpu.configure(devices) if cpu_defaults else None
        self._run_cache: dict[Any, tuple[Callable, dict]] = {}
        self._layouts: dict[Any, Any] = {}  # sharding -> _layout(sharding)
        self.rules = rules
        self.strict = strict
        self._plan: sharding.ShardingPlan | None = None
        self._graph_fns: dict[Any, Callable] = {}  # NNX steps as pure functions
        self._island_axis: str | None = None  # DiLoCo's (`wrap_optimizer(sync=...)`)
        self._num_islands = 1  # its size (mesh.shape builds a dict: not per call)
        self._tensor_parallel = self.mesh.shape["tensor"] > 1  # (mesh.shape builds a dict)

    def __repr__(self) -> str:
        axes = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        return f"Replicator({axes}; {self.num_replicas} replicas; {self.precision.name})"

    @contextlib.contextmanager
    def context(self) -> Iterator[Replicator]:
        """Makes this Replicator's mesh the ambient one, like ``strategy.scope()``.

        Inside, bare `PartitionSpec`s (e.g. in `jax.lax.with_sharding_constraint`)
        refer to this mesh.
        """
        with jax.set_mesh(self.mesh):
            yield self

    # ---------------------------------------------------------------- inputs

    def shard_batch(self, host_batch: PyTree) -> PyTree:
        """Assembles a global batch from each process's local part.

        Args:
          host_batch: a pytree of numpy arrays, this process's share of the global
            batch, batch on axis 0 (every process passes the same structure).

        Returns:
          The same pytree of global `jax.Array`s, split over the replicas on axis 0.
          A step may donate them: that consumes these arrays, never ``host_batch``.
        """
        leaves = jax.tree.leaves(host_batch)
        sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
        if None in sizes or len(sizes) != 1:
            shapes = jax.tree.map(np.shape, host_batch)
            raise ValueError(
                "shard_batch needs every leaf to have the same leading (batch) size; "
                f"got shapes {shapes}."
            )
        (local_size,) = sizes
        feeders = self._feeders
        global_size = local_size * feeders
        if global_size % self.num_replicas:
            raise ValueError(
                f"Global batch of {global_size} examples ({local_size} per process x "
                f"{feeders} processes) does not split over {self.num_replicas} "
                f"replicas; use a batch size that is a multiple of {self.num_replicas}, or "
                "pad the batch and pass a mask as sample_weight."
            )
        batch = jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(x)),
            host_batch,
        )
        if global_size == self.num_replicas:
            # One example per replica looks like a per-replica value: remember it is not.
            for x in jax.tree.leaves(batch):
                pr.remember(x, Kind.BATCH)
        return batch

    def process_rows(self, global_batch_size: int) -> slice:
        """The rows of each global batch that this process passes to `shard_batch`.

        In a multi-process run every process feeds its own part of the global
        batch: ``repl.shard_batch(global_batch[repl.process_rows(len(global_batch))])``
        on every process assembles exactly ``global_batch``. With one process it
        is every row.

        Args:
          global_batch_size: the rows of the global batch, a multiple of the
            number of processes and of `num_replicas`.

        Returns:
          A ``slice``: ``global_batch_size // jax.process_count()`` rows when the
          replicas span the processes (data parallelism), all of them where each
          process holds every replica's rows.

        >>> rp.Replicator().process_rows(16)
        slice(0, 16, None)
        """
        processes = self._feeders
        for count, what in ((processes, "processes"), (self.num_replicas, "replicas")):
            if global_batch_size <= 0 or global_batch_size % count:
                raise ValueError(
                    f"A global batch of {global_batch_size} rows does not split evenly over "
                    f"{count} {what}; use a multiple of "
                    f"{math.lcm(processes, self.num_replicas)}."
                )
        indices = self.batch_sharding.addressable_devices_indices_map((global_batch_size,))
        rows = sorted({idx[0].indices(global_batch_size)[:2] for idx in indices.values()})
        start, stop = rows[0][0], rows[-1][1]
        if sum(b - a for a, b in rows) != stop - start:
            raise ValueError(
                f"Process {jax.process_index()} holds rows {rows} of the batch, which are "
                "not contiguous; build the Replicator with devices ordered by process."
            )
        return slice(start, stop)

    def distribute(self, batches: Iterable[PyTree], prefetch: int = 2) -> Iterator[PyTree]:
        """Turns an iterable of host batches into global batches, prefetched.

        A background thread runs `shard_batch` up to ``prefetch`` batches ahead, so
        the host-to-device copy overlaps the step. Errors in the input pipeline are
        raised in the caller's thread.

        Args:
          batches: yields process-local numpy pytrees (e.g. a grain loader).
          prefetch: how many global batches to keep ready.

        Returns:
          An iterator of global batches, each as `shard_batch` returns it (a step
          may donate it). If ``batches`` has ``get_state()`` (grain iterators
          do), so does the result: the source's state right after the last batch
          *returned*, not the ones prefetched, so that a checkpoint resumes with
          exactly the next batch.
        """
        return _Prefetcher(iter(batches), self.shard_batch, prefetch)

    def replicate(self, tree: PyTree) -> PyTree:
        """Places a pytree mirrored on every device of the mesh.

        Args:
          tree: arrays (numpy or jax) with the same values on every process, or
            Flax NNX objects (Module, Optimizer, Rngs, metrics), alone or in a
            tuple, list or dict.

        Returns:
          The pytree as global `jax.Array`s, replicated over the mesh, in buffers of
          their own: a step that donates them (``donate_argnums``) consumes these
          arrays, never the caller's. NNX objects come back as new objects holding
          the placed arrays (references shared between them stay shared); the
          caller's are left as they were.
        """
        if graphs.contains_graph_nodes(tree):
            call = graphs.split_call((tree,))
            placed = self.replicate(call.args)
            (tree,), _ = graphs.merge_call(call.layout, placed)
            return tree

        def place(x):
            if isinstance(x, jax.Array) and x.is_fully_addressable and jax.process_count() == 1:
                placed = jax.device_put(x, self.mirrored_sharding, may_alias=False)
                # may_alias=False is not enough: broadcasting to several devices, JAX reuses
                # x's buffer on the device x is on. Donating the result would delete x.
                return jnp.copy(placed) if _shares_buffers(placed, x) else placed
            if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
                # Typed PRNG keys have no NumPy form: place their raw data, re-wrap.
                data = place(jax.random.key_data(x))
                return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
            return jax.make_array_from_process_local_data(self.mirrored_sharding, np.asarray(x))

        return jax.tree.map(place, tree)

    # ------------------------------------------------------------- sharding

    def param_shardings(self, abstract_params: PyTree) -> PyTree:
        """Where each parameter lives on this mesh, from the rules (`replicator.sharding`).

        Args:
          abstract_params: parameters or their shapes (``jax.eval_shape``), with
            flax logical-axis annotations (``nn.with_logical_partitioning``) or
            without (path rules and automatic FSDP apply).

        Returns:
          The same structure of `NamedSharding`s (flax boxes kept).
        """
        self._plan = sharding.plan_param_shardings(
            abstract_params, self.mesh, self.rules, strict=self.strict
        )
        return self._plan.shardings

    def init(self, init_fn: Callable, *args: Any) -> PyTree:
        """``init_fn(*args)`` created directly in its shardings: parameters as
        `param_shardings` says, optimizer state like its parameters, the rest
        mirrored; no device ever holds a whole sharded leaf.

        Example::

          state = repl.init(lambda key: rp.TrainState.create(
              model.init(key, x)["params"], tx, key), jax.random.key(0))
        """
        state = sharding.init_sharded(init_fn, self.param_shardings, *args)
        for x in jax.tree.leaves(state):  # a parameter split like a batch (a rule's choice)
            if self._layout(getattr(x, "sharding", None)) is _SPLIT:
                pr.remember(x, Kind.SHARDED)
        return state

    def sharding_report(self, state: PyTree) -> str:
        """Bytes per device per top-level subtree, the largest parameters left
        replicated, and which rule sharded what."""
        return sharding.sharding_report(state, self.mesh, self._plan or self.rules)

    # ------------------------------------------------------- per-replica path

    def run(
        self,
        fn: Callable,
        *args: PyTree,
        donate_argnums: Sequence[int] = (),
        replica_rngs: bool = True,
    ) -> PyTree:
        """Runs ``fn`` once per replica, as one compiled SPMD program.

        Each argument leaf reaches the replicas in one of three ways:

        * a batch split over the replicas (from `shard_batch`/`distribute`): each
          replica sees its own slice;
        * a per-replica value (an output of `run` that varied per replica, or a
          value marked `PerReplica`), stacked ``[num_replicas, ...]``: each replica
          sees its own row, without the leading axis;
        * anything else is mirrored: every replica sees all of it.

        Inside ``fn``, `compute_average_loss` knows the global batch,
        `get_replica_context` says which replica this is and `replica_key` gives
        it keys of its own; collectives take `axis_name`.

        Output leaves that are the same on every replica (e.g. parameters updated
        from all-reduced gradients) come back mirrored, with their own shape;
        leaves that vary come back stacked on a new leading axis of size
        `num_replicas` (per-replica values: see `reduce`), and passed back into
        ``run`` they round-trip.

        Flax NNX objects (Module, Optimizer, Rngs, metrics) are taken with
        ``nnx.jit``'s semantics: what ``fn`` changes in them (parameters,
        optimizer state, BatchNorm statistics, RNG counters, metric totals) is
        written back into the caller's objects after the call. Each replica's
        `nnx.Rngs` draw their own stream (``replica_rngs=False``: the same
        stream on every replica); metric totals and counts are summed over the
        replicas; any other variable that ends up differing between replicas is
        an error naming it.

        ``fn`` is traced and compiled once per argument structure and shape;
        call `run` with the same function object every step.

        Args:
          fn: the per-replica step function.
          *args: its arguments (pytrees of arrays).
          donate_argnums: positions of ``args`` whose buffers may be reused for
            the outputs (e.g. the train state).
          replica_rngs: give each replica its own stream from the `nnx.Rngs` in
            ``args`` (folding the replica id into their keys for the step).

        Returns:
          ``fn``'s outputs, as global arrays.

        Raises:
          ValueError: a per-replica value does not have one row per replica, or
            an array split over the replicas with exactly ``num_replicas`` rows
            is neither a known batch nor a known per-replica value.
          AxisNameError: ``fn`` used a collective over an axis that is not
            `axis_name`.
        """
        if graphs.has_graph_nodes(args):
            return self._run_graph(fn, args, donate_argnums, replica_rngs)
        step, meta, flat = self._run_step(fn, args, donate_argnums)
        if step is None:  # NNX objects nested deeper in the arguments
            return self._run_graph(fn, args, donate_argnums, replica_rngs)
        out = self._in_flight.dispatch(step, *flat)
        for i, kind in meta["remember"]:  # outputs whose role a later call must know
            pr.remember(out[i], kind)
        if meta["grows"]:
            self._check_growth(meta["grows"], flat, args)
        return jax.tree.unflatten(meta["tree"], out)

    def _run_graph(self, fn, args, donate_argnums, replica_rngs) -> PyTree:
        call = graphs.split_call(args)
        pure = self._graph_fn(fn, call, replica_rngs)
        donate = graphs.donated_positions(call.layout, donate_argnums)
        program = functools.partial(self.run, pure, donate_argnums=donate)
        out, new_state = graphs.call_program(program, call, self._device_set, self.axis_name)
        graphs.write_back(call, new_state)
        return out

    def _graph_fn(self, fn, call: graphs.SplitCall, replica_rngs: bool) -> Callable:
        key = (fn, call.layout, replica_rngs)
        pure = self._graph_fns.get(key)
        if pure is None:  # checked before the first trace; later calls, if they fail
            graphs.check_placement(call, self._device_set)
            pure = self._graph_fns[key] = graphs.make_pure(
                fn, call.layout, replica_rngs=replica_rngs
            )
        return pure

    def lower(
        self, fn: Callable, *args: PyTree, donate_argnums: Sequence[int] = ()
    ) -> jax.stages.Lowered:
        """The program that ``run(fn, *args)`` executes, lowered, as `jax.jit(...).lower`.

        ``lower(...).compile()`` after a ``run`` with the same arguments reuses
        the compiled program; its ``cost_analysis()`` gives XLA's FLOP count
        per device, ``as_text()`` the HLO. Arguments only need the shapes and
        shardings of real ones (donated arrays do).
        """
        step, _, flat = self._run_step(fn, args, donate_argnums)
        if step is None or graphs.has_graph_nodes(args):  # the program on the objects' state
            call = graphs.split_call(args)
            donate = graphs.donated_positions(call.layout, donate_argnums)
            return self.lower(self._graph_fn(fn, call, True), *call.args, donate_argnums=donate)
        return step.lower(*flat)

    def _run_step(self, fn: Callable, args: tuple, donate_argnums: Sequence[int]):
        if self._island_axis is not None:
            args = diloco.island_args(args, self._num_islands, self._island_rows)
        flat, treedef = jax.tree.flatten(args)
        kinds = self._kinds(flat, args)
        if kinds is None:  # rp.PerReplica leaves: placed one row per replica first
            args = self._place_marked(args)
            flat, treedef = jax.tree.flatten(args)
            kinds = self._kinds(flat, args)
        donate = tuple(sorted(donate_argnums))
        # Where mirrored inputs sit on "tensor": their outputs are pinned there too.
        placed = (
            tuple(getattr(x, "sharding", None) if k is Kind.MIRRORED else None
                  for x, k in zip(flat, kinds))
            if self._tensor_parallel else None
        )  # fmt: skip
        key = (fn, treedef, kinds, donate, placed)
        entry = self._run_cache.get(key)
        if entry is None and graphs.contains_graph_nodes(args):
            entry = self._run_cache[key] = (None, None)  # `run` splits the NNX objects out
        if entry is None:
            meta: dict[str, Any] = {}
            step = jax.jit(
                self._per_replica(fn, treedef, kinds, meta, placed),
                donate_argnums=_leaf_positions(args, donate),
                compiler_options=self._compiler_options,
            )
            entry = self._run_cache[key] = (step, meta)
        return entry[0], entry[1], flat

    def _kinds(self, flat: list, args: tuple) -> tuple[Kind | NamedSharding, ...] | None:
        """How each argument leaf reaches the replicas (a `NamedSharding`: a parameter
        sharded over them, gathered for the step), or None if a leaf is an unplaced
        `PerReplica`; per call, so kept cheap: what a sharding means is worked out
        once per sharding."""
        # Module-level names, not Kind.X: enum attribute lookups cost in this loop.
        kinds, layouts, known = [], self._layouts, pr.known_kind
        sharding_of = compat.leading_sharding
        for i, x in enumerate(flat):
            sharding = sharding_of(x)
            layout = layouts.get(sharding, _UNSEEN) if sharding is not None else None
            if layout is _UNSEEN:
                layout = layouts[sharding] = self._layout(sharding)
            if layout is None:
                if sharding is None and type(x) is PerReplica:
                    return None
                kinds.append(_MIRRORED)
            elif layout is _SPLIT:
                kind = known(x)
                # The common case, a batch of more rows than replicas, decided here.
                if kind is None and x.shape[0] != self.num_replicas:
                    kinds.append(_BATCH)
                else:
                    kinds.append(self._split_kind(x, args, i))
            else:
                kind = known(x)
                kinds.append(kind if kind is _PER_REPLICA or kind is _PER_ISLAND else x.sharding)
        return tuple(kinds)

    def _layout(self, sharding: Any) -> Any:
        """None: not split over the replicas (mirrored, or split over ``tensor`` only);
        _SPLIT: split on axis 0 like a batch; _SHARDED: a parameter split over them."""
        if not isinstance(sharding, NamedSharding) or (
            sharding.mesh.axis_names != self.mesh.axis_names
        ):
            return None
        entries = [_as_tuple(e) or () for e in sharding.spec]
        if not any(a in self.axis_name for e in entries for a in e):
            return None
        batch_like = entries[0] in (DATA_AXES, ("data",) if self.axis_name == ("data",) else ())
        if batch_like and not any(a in DATA_AXES for e in entries[1:] for a in e):
            return _SPLIT
        return _SHARDED

    def _check_growth(self, grows: list[int], flat: list, args: tuple) -> None:
        """Raises for a mirrored argument, not placed on the mesh, that came back with one
        more axis (a host copy of a per-replica value, passed back unmarked: it would
        grow every step). One placed with `replicate` is mirrored by choice."""
        for index in grows:
            if not isinstance(getattr(flat[index], "sharding", None), NamedSharding):
                shape = np.shape(flat[index])
                raise ValueError(
                    f"run: argument {_leaf_path(args, index)} (shape {shape}) came in "
                    f"mirrored and left per replica with shape {(self.num_replicas, *shape)}: "
                    "a per-replica value copied to the host and passed back unmarked grows "
                    "an axis every step. Pass rp.PerReplica(value) for a per-replica value "
                    "(each replica gets its row), or repl.replicate(value) for a mirrored "
                    "one (each replica gets all of it)."
                )

    def _split_kind(self, x: Any, args: tuple, index: int) -> Kind | NamedSharding:
        kind = pr.known_kind(x)
        if kind is Kind.SHARDED:  # a parameter that only looks like a batch
            return x.sharding
        if kind is Kind.PER_ISLAND:
            return kind
        rows = x.shape[0]
        if kind is Kind.PER_REPLICA and rows != self.num_replicas:
            raise ValueError(
                f"run: argument {_leaf_path(args, index)} is a per-replica value with {rows} "
                f"rows, but this Replicator has {self.num_replicas} replicas (one row per "
                f"replica). It was made for {rows} replicas: reduce it there, or rebuild it "
                f"with {self.num_replicas} rows and pass rp.PerReplica(value)."
            )
        if kind is None and rows == self.num_replicas:
            raise ValueError(
                f"run: argument {_leaf_path(args, index)} (shape {x.shape}) is split over "
                f"the {self.num_replicas} replicas with one row each: it could be a batch of "
                f"{rows} examples or a per-replica value, and run cannot tell which. Pass "
                "rp.PerReplica(value) for a per-replica value (each replica gets its row), "
                "or make the batch with repl.shard_batch (each replica gets a slice)."
            )
        return kind or Kind.BATCH

    def _island_rows(self, tree: PyTree) -> PyTree:
        """``tree`` as per-island values (DiLoCo's parameters), each island's row a
        copy of it."""
        n = self._num_islands
        stack = jax.jit(
            lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), t),
            out_shardings=NamedSharding(self.mesh, P(self._island_axis)),
        )
        rows = stack(tree)
        for x in jax.tree.leaves(rows):
            pr.remember(x, Kind.PER_ISLAND)
        return rows

    def _place_marked(self, args: tuple) -> tuple:
        """Replaces each `PerReplica` by its leaves, split one row per replica."""

        def place(x):
            rows = np.shape(x)[0] if np.ndim(x) else None
            if rows != self.num_replicas:
                raise ValueError(
                    f"rp.PerReplica needs one row per replica: a leading axis of size "
                    f"{self.num_replicas}, got shape {np.shape(x)}."
                )
            if getattr(x, "sharding", None) != self.batch_sharding:
                if isinstance(x, jax.Array) and x.is_fully_addressable:
                    x = jax.device_put(x, self.batch_sharding)
                else:
                    host = np.asarray(x)
                    x = jax.make_array_from_callback(
                        host.shape, self.batch_sharding, lambda index: host[index]
                    )
            pr.remember(x, Kind.PER_REPLICA)
            return x

        def unwrap(x):
            return jax.tree.map(place, x.values) if isinstance(x, PerReplica) else x

        return jax.tree.map(unwrap, args)

    def _per_replica(self, fn: Callable, treedef, kinds: tuple, meta: dict, placed=None):
        axes, policy = self.axis_name, self.precision
        ctx = ReplicaContext(self.num_replicas, axes)
        shardings = [k if isinstance(k, NamedSharding) else None for k in kinds]
        # Key paths of the leaves: the wrapped optimizer pairs gradients with parameters.
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(
            jax.tree.unflatten(treedef, range(len(kinds))))[0]]  # fmt: skip
        island = self._island_axis
        in_specs = tuple(
            P() if k is Kind.MIRRORED
            else P(island) if k is Kind.PER_ISLAND
            else P(axes) if isinstance(k, Kind)
            else zero.manual_spec(k, axes)
            for k in kinds
        )  # fmt: skip
        # Manual over the replica axes only, so that "tensor" stays compiler-
        # partitioned. Manual over all (each replica's tensor devices compute
        # alike) without a tensor axis, and on CPU in bf16/fp16, where XLA:CPU
        # 0.10 aborts compiling the partly manual program's low-precision all-reduces.
        low_precision = self.precision.compute_dtype != jnp.float32
        cpu_low = self.mesh.devices.flat[0].platform == "cpu" and low_precision
        # With one replica, XLA's partitioner cannot keep a manual subgroup of size 1
        # (its collectives fail a RET_CHECK): then the tensor devices compute alike.
        partial = self._tensor_parallel and not cpu_low and self.num_replicas > 1
        if self._tensor_parallel and self.num_replicas == 1:
            warnings.warn(
                "run on a mesh of one replica: the step runs whole on each of the "
                f"{self.mesh.shape['tensor']} tensor devices (exact, no tensor parallelism). "
                "For tensor parallelism with one replica use repl.compile "
                "(step_path='compile' in the trainer), or give data or fsdp more devices.",
                stacklevel=4,
            )
        manual = set(DATA_AXES) if partial else set(self.mesh.axis_names)
        shard_map = lambda body, out_specs: jax.shard_map(
            body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
            axis_names=manual, check_vma=True,
        )  # fmt: skip

        def call(*flat, whole=False):
            rows = [x[0] if k in _ROWS else x for x, k in zip(flat, kinds)]
            rows, trace = zero.gather_inputs(
                rows, [None] * len(rows) if whole else shardings, axes, paths
            )
            name = getattr(fn, "__name__", "step")
            with replica_context(ctx, name), zero.tracing(trace), expect_policy(policy, fn):
                out = fn(*jax.tree.unflatten(treedef, rows))
                # How each output leaves: mirrored (None), stacked per replica
                # (_SPLIT), or sharded like the sharded input it stands for.
                layouts = []
                for path, x in jax.tree_util.tree_flatten_with_path(out)[0]:
                    varying = varying_axes(x, axes)
                    sharded = zero.output_sharding(x, varying, path)
                    if varying and varying == (island,):  # a DiLoCo island's value
                        sharded = _ISLAND
                    layouts.append(sharded or (_SPLIT if varying else None))
                leaves, tree = jax.tree.flatten(out)
                # A sharded output's slice: the one it was gathered from, if it was.
                pieces = [
                    zero.slice_for(x, zero.manual_spec(layout, axes))
                    if isinstance(layout, NamedSharding) else None
                    for x, layout in zip(leaves, layouts)
                ]  # fmt: skip
            return leaves, tree, layouts, pieces

        def run_all_replicas(*flat):
            # First trace: how each output leaves decides the out_specs.
            found = {}

            def probe(*flat):
                _, found["tree"], found["layouts"], _ = call(*flat)
                return ()

            try:
                jax.eval_shape(shard_map(probe, ()), *flat)
            except (AssertionError, NameError, ValueError) as e:
                self._raise_for_axis_names(e, call, flat, kinds)
                raise
            layouts = found["layouts"]

            def body(*flat):
                leaves, _, _, pieces = call(*flat)
                out = []
                for x, layout, piece in zip(leaves, layouts, pieces):
                    if layout is _SPLIT:
                        x = _stack(x, axes)
                    elif layout is _ISLAND:
                        x = x[None]
                    elif piece is not None:
                        x = piece
                    elif layout is not None and not varying_axes(x, axes):  # whole: keep a slice
                        x = zero.local_slice(x, zero.manual_spec(layout, axes))
                    out.append(x)
                return tuple(out)

            out_specs = tuple(
                P() if layout is None
                else P(DATA_AXES) if layout is _SPLIT
                else P(island) if layout is _ISLAND
                else zero.manual_spec(layout, axes)
                for layout in layouts
            )  # fmt: skip
            meta["tree"] = found["tree"]
            # Outputs a later call must tell apart: per-replica and per-island values,
            # and parameters sharded like a batch (remembered as parameters).
            meta["remember"] = [
                (i, Kind.PER_REPLICA) if layout is _SPLIT
                else (i, Kind.PER_ISLAND) if layout is _ISLAND
                else (i, Kind.SHARDED)
                for i, layout in enumerate(layouts)
                if layout is _SPLIT or layout is _ISLAND
                or (isinstance(layout, NamedSharding) and self._layout(layout) is _SPLIT)
            ]  # fmt: skip
            out = shard_map(body, out_specs)(*flat)
            # Mirrored inputs of one row per replica that came back one axis longer
            # (checked per call, where run can see how the input was placed).
            stacked = {out[i].shape for i, kind in meta["remember"] if kind is Kind.PER_REPLICA}
            meta["grows"] = [
                i
                for i, (x, kind) in enumerate(zip(flat, kinds))
                if kind is Kind.MIRRORED
                and x.shape[:1] == (self.num_replicas,)
                and (self.num_replicas, *x.shape) in stacked
            ]
            return tuple(
                jax.lax.with_sharding_constraint(x, layout) if isinstance(layout, NamedSharding)
                else self._mirrored_layout(x, flat, placed) if layout is None
                else x
                for x, layout in zip(out, layouts)
            )  # fmt: skip

        # Named after the step in compile logs, profiles and HLO dumps: jit_run_<fn>.
        run_all_replicas.__name__ = f"run_{getattr(fn, '__name__', 'step')}"
        return run_all_replicas

    def _mirrored_layout(self, x: jax.Array, flat: tuple, placed: tuple | None) -> jax.Array:
        """A mirrored output, pinned where the compiler would choose (over ``tensor``): as
        the mirrored input of its shape and dtype was (its old value), else replicated."""
        if placed is None:
            return x
        for arg, where in zip(flat, placed):
            if isinstance(where, NamedSharding) and (arg.shape, arg.dtype) == (x.shape, x.dtype):
                return jax.lax.with_sharding_constraint(x, where)
        return jax.lax.with_sharding_constraint(x, self.mirrored_sharding)

    def _raise_for_axis_names(self, error: Exception, call, flat, kinds) -> None:
        """Turns a collective over an axis that is not the replicas' into an `AxisNameError`.

        Inside ``shard_map`` such a collective fails with a bare assertion; traced
        again outside it, with the replica axes bound, it names the axis.
        """
        if isinstance(error, AxisNameError):
            raise error
        local = []
        for x, kind in zip(flat, kinds):
            shape = x.shape
            if kind is Kind.BATCH:
                shape = (shape[0] // self.num_replicas, *shape[1:])
            elif kind in _ROWS:
                shape = shape[1:]
            local.append(jax.ShapeDtypeStruct(shape, x.dtype))
        try:  # sharded arguments given whole (their global shape)
            whole = _bind_axes(lambda *xs: call(*xs, whole=True)[0], self._one_replica_axes)
            jax.eval_shape(whole, *local)
        except NameError as e:
            name = _unbound_axis(e)
            if name is not None and name not in self._one_replica_axes:
                raise self._axis_error(name, "run") from error
        except Exception:  # noqa: BLE001  (only a diagnosis; the original error stands)
            pass

    def _axis_error(self, name: str, path: str) -> AxisNameError:
        return AxisNameError(
            f"The step passes axis name {name!r} to a collective (lax.psum, pmean, "
            f"axis_index, all_gather, nn.BatchNorm(axis_name=...)) under repl.{path}, but "
            f"the replicas' axis is repl.axis_name = {self.axis_name!r}. Pass repl.axis_name "
            "(or rp.get_replica_context().axis_name) instead of a hard-coded name."
        )

    def reduce(self, op: ReduceOp, value: PyTree) -> PyTree:
        """Combines per-replica values.

        Outside `run`, ``value`` is what `run` returned for varying outputs: each
        leaf stacked on a leading axis of size `num_replicas` (or a `PerReplica`),
        and the result has that axis summed (or averaged) away. Inside `run` it is
        the cross-replica all-reduce of the replica's own value (``psum``/``pmean``);
        inside a step under `compile`, where one replica holds the whole batch, it
        returns ``value`` unchanged.

        Args:
          op: `ReduceOp.SUM` or `ReduceOp.MEAN`.
          value: a pytree of per-replica values.

        Returns:
          The reduced pytree; the same value for every replica.
        """
        op = ReduceOp(op)
        ctx = get_replica_context()
        if ctx is not None:
            collective = jax.lax.psum if op is ReduceOp.SUM else jax.lax.pmean
            axes = ctx.axis_name
            return jax.tree.map(lambda x: collective(vary(x, axes), axes), value)
        if in_global_view():
            island = island_axis()
            if island is None:
                return value
            # compile under DiLoCo: each island's global view; combine the islands.
            collective = jax.lax.psum if op is ReduceOp.SUM else jax.lax.pmean
            return jax.tree.map(lambda x: collective(vary(x, (island,)), island), value)

        def check(x):
            if np.ndim(x) < 1 or np.shape(x)[0] != self.num_replicas:
                raise ValueError(
                    f"reduce expects per-replica values stacked on a leading axis of size "
                    f"{self.num_replicas}, got shape {np.shape(x)}. `run` returns a value "
                    "mirrored (unstacked) when it is the same on every replica, e.g. a "
                    "constant such as len(batch); derive per-replica counts from the batch "
                    "(jnp.sum(mask)) or reduce inside the step."
                )

        value = jax.tree.map(lambda x: x.values if isinstance(x, PerReplica) else x, value)
        jax.tree.map(check, value)
        # Summing a stacked value over the devices is a collective program too: it
        # counts among the steps in flight, or a loop of run + reduce queues without
        # bound and can time out XLA:CPU's rendezvous.
        return self._in_flight.dispatch(_reduce_stacked, value, mean=op is ReduceOp.MEAN)

    def wrap_optimizer(
        self, tx: optax.GradientTransformation, sync: diloco.DiLoCo | None = None
    ) -> optax.GradientTransformation:
        """Wraps an optax optimizer so per-replica gradients are summed across replicas.

        With `compute_average_loss` dividing each replica's loss by the global
        batch, the summed gradient is the gradient of the global-batch mean. Under
        `compile` the wrapper changes nothing, so one step function serves both
        paths. The optimizer state is exactly ``tx``'s. See `replicator.optim`.

        ``sync=rp.DiLoCo(inner_steps=H)`` trains islands instead (the replicas
        along ``DiLoCo.axis``): gradients are summed inside each island, and the
        islands average their parameters through an outer optimizer every H
        steps (`replicator.diloco`; under `run` and `compile`).
        """
        if sync is not None:
            if not isinstance(sync, diloco.DiLoCo):
                raise TypeError(f"sync must be None or rp.DiLoCo(...), got {sync!r}.")
            if sync.axis not in DATA_AXES:
                raise ValueError(
                    f"DiLoCo(axis={sync.axis!r}): islands are replicas along one of the "
                    f"replica axes {DATA_AXES}."
                )
            # run places DiLoCo train states per island (when there are several);
            # elastic islands are processes, and this Replicator's replicas one island.
            several = self.mesh.shape[sync.axis] > 1 and not sync.elastic
            self._island_axis = sync.axis if several else None
            self._num_islands = self.mesh.shape[sync.axis] if several else 1
        return optim.wrap_optimizer(tx, self.axis_name, sync)

    def apply_policy(self, model: Any) -> Any:
        """``model`` (a Flax linen or NNX module) under this Replicator's precision policy.

        With ``precision="bf16"`` the model computes in bfloat16 from float32
        parameters and returns float32 outputs; see `rp.apply_policy`.
        """
        return apply_policy(model, self.precision)

    # -------------------------------------------------------- global-view path

    def compile(
        self,
        fn: Callable,
        *,
        donate_argnums: int | Sequence[int] = (),
        in_shardings: Any = None,
        out_shardings: Any = None,
        static_argnums: int | Sequence[int] = (),
        compiler_options: dict[str, Any] | None = None,
    ) -> Callable:
        """Compiles ``fn`` for the global view: `jax.jit` over this mesh (pjit).

        ``fn`` sees global arrays; batches from `shard_batch` stay split over the
        data axes and the compiler inserts the collectives. The global view is one
        replica holding the whole batch: collectives over `axis_name` act over
        that one replica (``psum``/``pmean`` return their input, ``axis_index`` is
        0), so a step written for `run` (e.g. with
        ``nn.BatchNorm(axis_name=repl.axis_name)``) runs here unchanged and
        computes the same numbers. Calls are bounded in flight like `run`.

        Args:
          fn: the step function.
          donate_argnums: arguments whose buffers the outputs may reuse.
          in_shardings: optional shardings for the inputs (default: as they come).
          out_shardings: optional shardings for the outputs (default: propagated).
          static_argnums: as for `jax.jit`.
          compiler_options: XLA options, on top of replicator's CPU defaults.

        Flax NNX objects among the arguments are taken with ``nnx.jit``'s
        semantics, as by `run`: what the step changes in them is written back.

        Returns:
          A callable with ``fn``'s signature. Its ``lower(*args)`` lowers the
          program for those arguments, like `Replicator.lower` for `run`.
        """
        graph_programs: dict[Any, Callable] = {}
        graph_trees: set = set()  # argument structures holding NNX objects below the top

        def graph_program(call: graphs.SplitCall) -> Callable:
            if in_shardings is not None or out_shardings is not None or static_argnums:
                raise TypeError(
                    "repl.compile takes Flax NNX objects as positional arguments, without "
                    "in_shardings, out_shardings or static_argnums."
                )
            compiled = graph_programs.get(call.layout)
            if compiled is None:  # checked before the first trace; later calls, if they fail
                graphs.check_placement(call, self._device_set)
                compiled = graph_programs[call.layout] = self.compile(
                    graphs.make_pure(fn, call.layout),
                    donate_argnums=graphs.donated_positions(
                        call.layout, _as_positions(donate_argnums)
                    ),
                    compiler_options=compiler_options,
                )
            return compiled

        def graph_step(*args, **kwargs):
            if kwargs:
                raise TypeError("repl.compile takes Flax NNX objects as positional arguments.")
            call = graphs.split_call(args)
            out, new_state = graphs.call_program(
                graph_program(call), call, self._device_set, self.axis_name
            )
            graphs.write_back(call, new_state)
            return out

        def has_graph_nodes(args) -> bool:  # the second look only once one was seen nested
            return graphs.has_graph_nodes(args) or bool(
                graph_trees and jax.tree.structure(args) in graph_trees
            )

        jit = functools.partial(
            jax.jit,
            donate_argnums=donate_argnums,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            static_argnums=static_argnums,
            compiler_options={**(self._compiler_options or {}), **(compiler_options or {})} or None,
        )
        mesh = self.mesh.abstract_mesh
        refused = graphs.refuse_graph_nodes(fn)  # NNX objects go through graph_step instead
        plain = jit(_in_global_view(refused, mesh, self.precision))
        current = [plain]
        bound = self._in_flight.bound
        islands: list = []  # DiLoCo: the per-island program, made on first use

        def island_step() -> Callable:
            if not islands:
                if static_argnums:
                    raise ValueError("repl.compile under DiLoCo takes no static_argnums.")
                positions = _as_positions(donate_argnums)
                islands.append(self._compile_islands(fn, positions, compiler_options))
            return islands[0]

        def step(*args, **kwargs):
            # A step given islands' train states (wrap_optimizer(sync=rp.DiLoCo)) runs
            # once per island; decided per call, whenever the optimizer was wrapped.
            if self._island_axis is not None and diloco.has_states(args):
                return island_step()(*args, **kwargs)
            if has_graph_nodes(args):
                return graph_step(*args, **kwargs)
            try:  # the fast path: jit's own dispatch, plus the bound where it is needed
                if bound:
                    return self._in_flight.dispatch(current[0], *args, **kwargs)
                return current[0](*args, **kwargs)
            except graphs.NestedGraphNodes:  # found while tracing: split them out from now on
                if kwargs:
                    raise TypeError(
                        "repl.compile takes Flax NNX objects as positional arguments."
                    ) from None
                graph_trees.add(jax.tree.structure(args))
                return graph_step(*args, **kwargs)
            except NameError as e:
                # A step without collectives compiles exactly as jax.jit(fn). One that
                # uses the replica axes is traced again with them bound to one replica.
                if not bind_replica_axes(e):
                    raise
                return step(*args, **kwargs)

        def bind_replica_axes(error: NameError) -> bool:
            """Whether ``error`` means: trace again with the replica axes bound to one
            replica; if so, the step is that program from now on."""
            if not self._bind_replica_axes(error, current, plain):
                return False
            current[0] = step.jitted = jit(
                _in_global_view(_bind_axes(refused, self._one_replica_axes), mesh, self.precision)
            )
            return True

        def lower(*args, **kwargs) -> jax.stages.Lowered:
            if self._island_axis is not None and diloco.has_states(args):
                return island_step().lower(*args, **kwargs)
            if graphs.contains_graph_nodes(args):
                call = graphs.split_call(args)  # the program on the objects' state
                return graph_program(call).lower(*call.args)
            try:
                return current[0].lower(*args, **kwargs)
            except NameError as e:
                if not bind_replica_axes(e):
                    raise
                return current[0].lower(*args, **kwargs)

        step.jitted, step.lower = plain, lower  # jitted: the jax.jit object in use
        step.__name__ = getattr(fn, "__name__", "step")
        return step

    def _compile_islands(self, fn: Callable, donate: tuple[int, ...], compiler_options) -> Callable:
        """`compile` under DiLoCo: ``fn`` in the global view of each island, as one
        program manual over the island axis only (``shard_map``; the other axes
        stay with the compiler). Per-island values (the islands' parameters and
        inner state) go in and come out one row per island, as under `run`."""
        island, cache = self._island_axis, {}
        options = {**(self._compiler_options or {}), **(compiler_options or {})} or None

        def prepare(args):
            args = diloco.island_args(args, self._num_islands, self._island_rows)
            flat, treedef = jax.tree.flatten(args)
            rows = tuple(pr.known_kind(x) is Kind.PER_ISLAND for x in flat)
            specs = tuple(
                P(island) if row
                else zero.manual_spec(x.sharding, (island,))
                if isinstance(getattr(x, "sharding", None), NamedSharding)
                else P()
                for x, row in zip(flat, rows)
            )  # fmt: skip
            key = (treedef, rows, specs)
            if key not in cache:
                program, meta = self._island_program(fn, treedef, rows, specs)
                positions = _leaf_positions(args, donate)
                program = jax.jit(program, donate_argnums=positions, compiler_options=options)
                cache[key] = program, meta
            return (*cache[key], flat)

        def step(*args, **kwargs):
            if kwargs:
                raise TypeError("repl.compile under DiLoCo takes positional arguments.")
            program, meta, flat = prepare(args)
            out = self._in_flight.dispatch(program, *flat)
            for i in meta["per_island"]:
                pr.remember(out[i], Kind.PER_ISLAND)
            return jax.tree.unflatten(meta["tree"], out)

        def lower(*args, **kwargs) -> jax.stages.Lowered:
            del kwargs
            program, _, flat = prepare(args)
            return program.lower(*flat)

        step.lower = lower
        step.__name__ = getattr(fn, "__name__", "step")
        return step

    def _island_program(self, fn: Callable, treedef, rows: tuple, specs: tuple):
        island, meta = self._island_axis, {}
        shard_map = lambda body, out_specs: jax.shard_map(
            body, mesh=self.mesh, in_specs=specs, out_specs=out_specs,
            axis_names={island}, check_vma=True,
        )  # fmt: skip

        def call(*local):
            leaves = [x[0] if row else x for x, row in zip(local, rows)]
            with global_view(), island_view(island):
                out = fn(*jax.tree.unflatten(treedef, leaves))
            leaves, tree = jax.tree.flatten(out)
            return leaves, tree

        def program(*flat):
            found = {}

            def probe(*local):
                leaves, found["tree"] = call(*local)
                found["island"] = [bool(varying_axes(x, (island,))) for x in leaves]
                return ()

            jax.eval_shape(shard_map(probe, ()), *flat)
            per_island = found["island"]

            def body(*local):
                leaves, _ = call(*local)
                return tuple(x[None] if i else x for x, i in zip(leaves, per_island))

            out_specs = tuple(P(island) if i else P() for i in per_island)
            meta["tree"] = found["tree"]
            meta["per_island"] = [k for k, i in enumerate(per_island) if i]
            out = shard_map(body, out_specs)(*flat)
            split = NamedSharding(self.mesh, P(island))
            return tuple(
                jax.lax.with_sharding_constraint(x, split if i else self.mirrored_sharding)
                for x, i in zip(out, per_island)
            )

        program.__name__ = f"islands_{getattr(fn, '__name__', 'step')}"
        return program, meta

    def _bind_replica_axes(self, error: NameError, current: list, plain: Callable) -> bool:
        """Whether a compiled step's unbound-axis error means: trace again with the
        replica axes bound; raises `AxisNameError` for an axis that is not theirs."""
        if isinstance(error, AxisNameError):
            return False
        name = _unbound_axis(error)
        if name is None:
            return False
        if name not in self._one_replica_axes or current[0] is not plain:
            raise self._axis_error(name, "compile") from error
        return True

    def wait(self) -> None:
        """Blocks until every dispatched step has finished."""
        self._in_flight.drain()


_UNSEEN, _SPLIT, _SHARDED = object(), object(), object()  # `Replicator._layout`s
_ISLAND = object()  # an output varying over DiLoCo's island axis only
_ROWS = (Kind.PER_REPLICA, Kind.PER_ISLAND)  # arguments each replica gets a row of
_MIRRORED, _BATCH, _PER_REPLICA, _PER_ISLAND = (
    Kind.MIRRORED, Kind.BATCH, Kind.PER_REPLICA, Kind.PER_ISLAND
)  # fmt: skip


def _shares_buffers(a: jax.Array, b: jax.Array) -> bool:
    """Whether ``a`` holds any of ``b``'s device buffers (True when it cannot tell)."""
    try:
        theirs = {s.data.unsafe_buffer_pointer() for s in b.addressable_shards}
        return any(s.data.unsafe_buffer_pointer() in theirs for s in a.addressable_shards)
    except Exception:  # a backend without buffer pointers: assume the worst, copy
        return True


def _as_tuple(entry) -> tuple[str, ...] | None:
    if entry is None:
        return None
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def _as_positions(argnums: int | Sequence[int]) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _leaf_positions(args: tuple, argnums: Sequence[int]) -> tuple[int, ...]:
    """Maps positions in ``args`` to positions in ``jax.tree.leaves(args)``."""
    positions, start = [], 0
    for i, arg in enumerate(args):
        count = len(jax.tree.leaves(arg))
        if i in argnums:
            positions.extend(range(start, start + count))
        start += count
    return tuple(positions)


def _feeding_processes(batch_sharding: NamedSharding, num_replicas: int) -> int:
    """Into how many parts the processes split a batch: the process count under data
    parallelism, 1 where every process holds every replica's rows."""
    rows = collections.defaultdict(set)
    for device, index in batch_sharding.devices_indices_map((num_replicas,)).items():
        rows[device.process_index].add(index[0].indices(num_replicas)[:2])
    return len({frozenset(r) for r in rows.values()})


def _leaf_path(args: tuple, index: int) -> str:
    """Names leaf ``index`` of ``run``'s arguments, e.g. ``args[1]['ema']``."""
    path, _ = jax.tree_util.tree_flatten_with_path(args)[0][index]
    return "args" + jax.tree_util.keystr(path)


def _stack(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    return vary(jnp.asarray(x), axes)[None]


def _in_global_view(
    fn: Callable, mesh: jax.sharding.AbstractMesh, policy: Policy | None = None
) -> Callable:
    """``fn`` traced as a global-view step: with the mesh ambient (bare
    `PartitionSpec`s refer to it) only while tracing, never on each call; told
    when the Replicator's ``policy`` goes unused (`expect_policy`)."""

    @functools.wraps(fn)
    def global_step(*args, **kwargs):
        with global_view(), jax.sharding.use_abstract_mesh(mesh):
            if policy is None:
                return fn(*args, **kwargs)
            with expect_policy(policy, fn):
                return fn(*args, **kwargs)

    # Named after the step in compile logs, profiles and HLO dumps: jit_<fn>.
    global_step.__name__ = getattr(
        fn, "__name__", getattr(getattr(fn, "func", None), "__name__", "step")
    )
    return global_step


def _bind_axes(fn: Callable, axes: Sequence[str]) -> Callable:
    """``fn`` with each of ``axes`` bound as a named axis of size 1 (one replica).

    A collective over them then acts over that single replica: ``psum`` and
    ``pmean`` return their input, ``axis_index`` is 0, ``all_gather`` adds an axis
    of size 1.
    """

    @functools.wraps(fn)
    def bound(*args, **kwargs):
        # The arguments go through vmap (unmapped) rather than being closed over, so
        # pytrees are rebuilt inside it: Flax NNX checks that its objects belong to
        # the trace level that uses them.
        one = lambda _, *args: fn(*args, **kwargs)
        for name in reversed(axes):
            one = jax.vmap(one, in_axes=(0,) + (None,) * len(args), axis_name=name)
        try:
            out = one(jnp.zeros((1,) * len(axes)), *args)
        except NotImplementedError as e:  # JAX's vmap of all_gather over several axes
            if len(axes) < 2 or "feature request" not in str(e):
                raise
            raise NotImplementedError(
                f"A collective that gathers or scatters over repl.axis_name = {tuple(axes)!r} "
                "(lax.all_gather, psum_scatter, all_to_all) cannot run under repl.compile when "
                "the replicas span several mesh axes: JAX cannot batch it over them. Under "
                "the global view there is one replica, so all_gather(x) is x[None]; or run "
                "the step with repl.run, or use a mesh whose replicas span one axis."
            ) from e
        return jax.tree.map(lambda x: x.reshape(x.shape[len(axes) :]), out)

    return bound


_UNBOUND = re.compile(r"unbound axis name:?\s*'?([^\s.,']+)")


def _unbound_axis(error: NameError) -> str | None:
    """The axis named by JAX's "unbound axis name" error, or None for other NameErrors."""
    match = _UNBOUND.search(str(error))
    return match.group(1) if match else None


@functools.partial(jax.jit, static_argnames="mean")
def _reduce_stacked(value: Any, mean: bool) -> Any:
    """Sums (or averages) each leaf of ``value`` over its leading, per-replica axis."""
    reduce = jnp.mean if mean else jnp.sum
    return jax.tree.map(lambda x: reduce(x, axis=0), value)


class _StepsInFlight:
    """Bounds how many dispatched steps may be unfinished (``bound``; 0: no bound).

    Keeps one output of each recent step (all outputs of one executable become
    ready together) and waits for the oldest when over the bound. Without a
    bound it only remembers the last step's outputs, for `drain`.
    """

    def __init__(self, bound: int):
        self.bound = bound
        self._pending: collections.deque[list[jax.Array]] = collections.deque()
        self._last: Any = None

    def dispatch(self, fn: Callable, *args, **kwargs) -> Any:
        out = fn(*args, **kwargs)
        if not self.bound:
            self._last = out
            return out
        arrays = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
        if arrays:
            self._pending.append([min(arrays, key=lambda x: x.size)])
        while len(self._pending) > self.bound:
            self._wait(self._pending.popleft())
        return out

    def _wait(self, arrays: list[jax.Array]) -> None:
        # An output may since have been donated into a later step; then that later
        # step's outputs stand for it (it cannot finish before this one).
        for candidates in itertools.chain((arrays,), self._pending):
            for x in candidates:
                if _block(x):
                    return

    def drain(self) -> None:
        while self._pending:
            self._wait(self._pending.popleft())
        last, self._last = self._last, None
        for x in jax.tree.leaves(last):
            if isinstance(x, jax.Array):
                _block(x)


def _block(x: jax.Array) -> bool:
    """Waits for ``x``; False if it was deleted or donated meanwhile."""
    if x.is_deleted():
        return False
    try:
        x.block_until_ready()
    except jax.errors.JaxRuntimeError as e:
        if "donated" in str(e) or "deleted" in str(e):
            return False
        raise
    return True


class _Prefetcher:
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

    def __iter__(self) -> _Prefetcher:
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
