"""The Replicator, a facade: one mesh, and the two ways of running a step function on it,
`run` (per replica, `replicator.spmd.replica_program`) and `compile` (the global view,
`replicator.spmd.global_view`), built together (`replicator.spmd.paths`), over the inputs,
reduction, optimizer and sharding modules (its rules: `replicator.parallel.sharding`'s
`ShardingPlanner`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import optax

from replicator.parallel import diloco as diloco
from replicator.parallel import groups as groups
from replicator.parallel import sharding as sharding
from replicator.parallel.mesh import build_mesh
from replicator.spmd import inputs as inputs
from replicator.spmd import reduction as reduction
from replicator.spmd.global_view import Compiled
from replicator.spmd.paths import build_paths
from replicator.spmd.reduction import ReduceOp
from replicator.step import optim as optim
from replicator.step.precision import Policy, apply_policy, get_policy

PyTree = Any


class Replicator:
    """Runs single-device step functions as one SPMD program over a device mesh.

    Args:
      devices: the devices to use; ``None`` means every device of every process.
      mesh: axis sizes for ``"data"``, ``"fsdp"`` and ``"tensor"`` (``-1`` = the rest); ``None``
        means pure data parallelism over all ``devices``.
      precision: ``None``/``"fp32"``, ``"bf16"``, ``"fp16"`` or a `Policy`: what `apply_policy`
        applies to a model and `TrainState.create` to a state (fp16 adds a dynamic loss scale).
      max_steps_in_flight: how many dispatched steps may be unfinished when `run` or a compiled
        step returns. ``None``: 2 on a mesh of several CPU devices (an unbounded queue has
        deadlocked XLA:CPU's all-reduce rendezvous), no bound elsewhere
        (`replicator.spmd.dispatch`).
      cpu_defaults: on a CPU mesh, apply `replicator.spmd.cpu.configure` (faster max pooling and
        convolutions, glibc keeping freed memory; some process-wide): 3-6x faster training of the
        tutorial CNN on CPU. False keeps JAX's defaults.
      rules: how parameters shard: ``(logical_axis, mesh_axis)`` pairs for flax logical-axis
        annotations, or ``(path_regex, (mesh_axis, ...))``; None: `sharding.DEFAULT_RULES` (FSDP on
        ``fsdp``, Megatron-style ``mlp``/``heads`` on ``tensor``). See `param_shardings`.
      strict: a rule that matches nothing, or a large parameter left replicated on a sharded mesh,
        is an error instead of a warning.
      dcn_mesh: axis sizes across TPU slices (or hosts), e.g. ``{"data": 2}``; ``mesh`` then gives
        the sizes within one slice (`replicator.parallel.mesh.hybrid_mesh_devices`): keep ``fsdp``
        and ``tensor`` inside slices, ``data`` (one all-reduce a step) across.
      min_size: parameters with fewer elements per layer (a scanned stack's ``layers`` axis not
        counted) get no automatic FSDP (and, with the default rules, stay whole); rules you pass
        apply whatever the size. 0 shards every parameter.

    Attributes:
      mesh: the `jax.sharding.Mesh`, axes ``("data", "fsdp", "tensor")``.
      axis_name: the mesh axes the replicas span (those of size > 1; ``("data",)`` on one
        device): the one name to pass to ``lax.psum``/``pmean``/``axis_index`` and
        ``nn.BatchNorm(axis_name=...)``, valid under `run` and `compile`.
      num_replicas: how many replicas `run` runs (the size of ``axis_name``).
      precision: the `Policy`.
      batch_sharding: how `shard_batch` splits a batch; mirrored_sharding: a value on every device.

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
        min_size: int = sharding.MIN_SHARD_SIZE,
    ):
        self.mesh = build_mesh(devices, mesh, dcn_mesh)
        self._planner = sharding.ShardingPlanner(self.mesh, rules, strict=strict, min_size=min_size)
        self.rules, self.strict, self.min_size = rules, strict, min_size
        self.precision = get_policy(precision)
        paths = build_paths(self.mesh, self.precision, rules, max_steps_in_flight, cpu_defaults)
        self._roles = roles = paths.roles
        self.axis_name, self.num_replicas = roles.axis_name, roles.num_replicas
        self.batch_sharding, self.mirrored_sharding = roles.batch_sharding, roles.mirrored_sharding
        self._feeders = inputs.feeding_processes(roles)
        self._in_flight, self._compiler_options = paths.in_flight, paths.compiler_options
        self._programs, self._global_view = paths.programs, paths.global_view
        self._run_cache, self._run_step = self._programs.cache, self._programs.prepare

    def __repr__(self) -> str:
        axes = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        replicas = f"{self.num_replicas} replica{'s' if self.num_replicas != 1 else ''}"
        return f"Replicator({axes}; {replicas}; {self.precision.name})"

    @contextlib.contextmanager
    def context(self) -> Iterator[Replicator]:
        """Makes this Replicator's mesh the ambient one, like ``strategy.scope()``: inside,
        bare `PartitionSpec`s (e.g. in `jax.lax.with_sharding_constraint`) refer to it."""
        with jax.set_mesh(self.mesh):
            yield self

    def shard_batch(self, host_batch: PyTree) -> PyTree:
        """Assembles a global batch from each process's local part.

        Args:
          host_batch: a pytree of numpy arrays, this process's share of the global batch, batch
            on axis 0 (every process passes the same structure).

        Returns:
          The same pytree of global `jax.Array`s, split over the replicas on axis 0; a step that
          donates them consumes these arrays, never ``host_batch``.
        """
        return inputs.shard_batch(host_batch, self._roles, self._feeders)

    def process_rows(self, global_batch_size: int) -> slice:
        """The rows of each global batch that this process passes to `shard_batch`:
        ``repl.shard_batch(global_batch[repl.process_rows(len(global_batch))])`` on every process
        assembles exactly ``global_batch``. ``global_batch_size``: a multiple of the number of
        processes and of `num_replicas`.

        Returns:
          A ``slice``: ``global_batch_size // jax.process_count()`` rows when the replicas span
          the processes (data parallelism), all of them where each process holds every replica.

        >>> Replicator().process_rows(16)
        slice(0, 16, None)
        """
        return inputs.process_rows(global_batch_size, self._roles, self._feeders)

    def distribute(self, batches: Iterable[PyTree], prefetch: int = 2) -> Iterator[PyTree]:
        """Turns an iterable of host batches into global batches, `shard_batch` run ``prefetch``
        batches ahead in a background thread; input errors are raised in the caller's thread.

        Args:
          batches: yields process-local numpy pytrees (e.g. a grain loader).
          prefetch: how many global batches to keep ready.

        Returns:
          An iterator of global batches, as `shard_batch` returns them. If ``batches`` has
          ``get_state()`` (grain iterators do), so does the result: the source's state after the
          last batch *returned*, not prefetched, so a checkpoint resumes with the next batch.
        """
        return inputs.Prefetcher(iter(batches), self.shard_batch, prefetch)

    def replicate(self, tree: PyTree) -> PyTree:
        """Places a pytree mirrored on every device of the mesh.

        Args:
          tree: arrays (numpy or jax) with the same values on every process, or Flax NNX
            objects (Module, Optimizer, Rngs, metrics), alone or in a tuple, list or dict.

        Returns:
          Global `jax.Array`s in buffers of their own (a step that donates them never consumes
          the caller's); NNX objects as new objects holding them, shared references kept.
        """
        return inputs.replicate(tree, self.mirrored_sharding)

    def param_shardings(self, abstract_params: PyTree) -> PyTree:
        """Where each parameter lives on this mesh, by its rules: for ``abstract_params``
        (parameters or their shapes, with flax logical-axis annotations or without: path rules
        and automatic FSDP apply), the same structure of `NamedSharding`s, flax boxes kept
        (`replicator.parallel.sharding_rules`)."""
        return self._planner.param_shardings(abstract_params)

    def init(self, init_fn: Callable, *args: Any) -> PyTree:
        """``init_fn(*args)`` created directly in its shardings: parameters as `param_shardings`
        says, optimizer state like its parameters, the rest mirrored; no device ever holds a
        whole sharded leaf. Example::

          state = repl.init(lambda key: rp.TrainState.create(
              model.init(key, x)["params"], tx, key), jax.random.key(0))
        """
        state = self._planner.init(init_fn, *args)
        self._roles.remember_sharded(state)  # a parameter split like a batch (a rule's choice)
        return state

    def sharding_report(self, state: PyTree) -> str:
        """Bytes per device per top-level subtree, the largest parameters left replicated, and
        which rule sharded what."""
        return self._planner.report(state)

    def run(
        self,
        fn: Callable,
        *args: PyTree,
        donate_argnums: Sequence[int] = (),
        replica_rngs: bool = True,
    ) -> PyTree:
        """Runs ``fn`` once per replica, as one compiled SPMD program.

        Each argument leaf reaches the replicas as a batch split over them (from `shard_batch`
        or `distribute`: each replica sees its slice), a per-replica value (an output of `run`
        that varied per replica, or marked `PerReplica`, stacked ``[num_replicas, ...]``: each
        sees its row), or mirrored (anything else: each sees all of it). Inside ``fn``,
        `compute_average_loss` knows the global batch, `get_replica_context` says which replica
        this is, `replica_key` gives it keys of its own; collectives take `axis_name`.

        Output leaves the same on every replica come back mirrored; leaves that vary come back
        stacked on a new leading axis of size `num_replicas` (see `reduce`), and round-trip
        when passed back. Flax NNX objects are taken with ``nnx.jit``'s semantics: what ``fn``
        changes in them is written back into the caller's objects; each replica's `nnx.Rngs`
        draw their own stream, metric totals are summed over the replicas, and any other
        variable that differs between replicas is an error naming it. ``fn`` is traced once
        per argument structure and shape: pass the same function object every step.

        Args:
          fn: the per-replica step function; ``*args``: its arguments (pytrees of arrays).
          donate_argnums: positions of ``args`` whose buffers the outputs may reuse.
          replica_rngs: each replica's own stream from the `nnx.Rngs` in ``args`` (False: the
            same stream on every replica).

        Returns:
          ``fn``'s outputs, as global arrays.

        Raises:
          ValueError: a per-replica value without one row per replica, or an array split over
            the replicas with ``num_replicas`` rows, neither a known batch nor per-replica.
          AxisNameError: ``fn`` used a collective over an axis that is not `axis_name`.
        """
        return self._programs.run(fn, args, donate_argnums, replica_rngs)

    def lower(
        self, fn: Callable, *args: PyTree, donate_argnums: Sequence[int] = ()
    ) -> jax.stages.Lowered:
        """The program ``run(fn, *args)`` executes, lowered, as `jax.jit(...).lower`: its
        ``compile()`` reuses run's program (``cost_analysis()``: XLA's FLOPs per device).
        Arguments only need the shapes and shardings of real ones (donated arrays do)."""
        return self._programs.lower(fn, args, donate_argnums)

    def reduce(self, op: ReduceOp, value: PyTree) -> PyTree:
        """Combines per-replica values: outside `run`, leaves stacked on a leading axis of size
        `num_replicas` (as `run` returns them, or a `PerReplica`) with that axis summed or
        averaged away; inside `run` the all-reduce of the replica's own value (``psum`` or
        ``pmean``); inside a step under `compile` (one replica) ``value`` unchanged.

        Args:
          op: `ReduceOp.SUM` or `ReduceOp.MEAN`.
          value: a pytree of per-replica values.

        Returns:
          The reduced pytree, the same value for every replica.
        """
        return reduction.reduce(op, value, self.num_replicas, self._in_flight)

    def wrap_optimizer(
        self,
        tx: optax.GradientTransformation,
        sync: diloco.DiLoCo | None = None,
        *,
        aggregate: optim.Aggregator | None = None,
        clip_norm: float | None = None,
        track_norm: bool = False,
    ) -> optax.GradientTransformation:
        """Wraps an optax optimizer so per-replica gradients are summed across replicas
        (`replicator.step.optim`): with `compute_average_loss`, the gradient of the global-batch
        mean. Under `compile` it changes nothing; the optimizer state is exactly ``tx``'s.
        ``sync=rp.DiLoCo(inner_steps=H)`` trains groups of replicas apart instead (one per
        index of ``DiLoCo.axis``): gradients summed within a group, parameters averaged
        through an outer optimizer every H steps (`replicator.parallel.diloco`; under `run` and
        `compile`). This Replicator is left as it was: the optimizer's state says where the
        groups are.

        Between the sum and ``tx``: ``aggregate`` replaces the sum (e.g. `rp.narrow_sum`);
        ``clip_norm`` clips the summed gradients by their global norm, as one device would clip
        the global batch's; ``track_norm`` (implied by ``clip_norm``) keeps that norm in the
        state for `rp.grad_norm` (`replicator.step.optim.wrap_optimizer` says more).
        """
        if sync is not None:
            groups.check_sync(sync)
        options = dict(aggregate=aggregate, clip_norm=clip_norm, track_norm=track_norm)
        return optim.wrap_optimizer(tx, self.axis_name, sync, **options)

    def apply_policy(self, model: Any) -> Any:
        """``model`` (a Flax linen or NNX module) under this Replicator's precision policy: with
        ``"bf16"`` it computes in bfloat16 from float32 parameters, returns float32."""
        return apply_policy(model, self.precision)

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

        ``fn`` sees global arrays; batches stay split over the data axes and the compiler
        inserts the collectives. The global view is one replica holding the whole batch:
        collectives over `axis_name` act over that one replica (``psum`` returns its input,
        ``axis_index`` is 0), so a step written for `run` (``nn.BatchNorm(axis_name=
        repl.axis_name)``) computes the same numbers here. Calls are bounded in flight like
        `run`'s; NNX objects are taken with ``nnx.jit``'s semantics, as by `run`.

        Args:
          fn: the step function; donate_argnums: arguments whose buffers the outputs may reuse.
          in_shardings, out_shardings: optional shardings (default: as they come; propagated).
          static_argnums: as for `jax.jit`; compiler_options: XLA options, on top of
            replicator's CPU defaults.

        Returns:
          A callable with ``fn``'s signature; ``lower(*args)`` lowers it, like `lower` for `run`.
        """
        return Compiled(
            self._global_view, fn, donate_argnums=donate_argnums, in_shardings=in_shardings,
            out_shardings=out_shardings, static_argnums=static_argnums,
            compiler_options=compiler_options,
        )  # fmt: skip

    def wait(self) -> None:
        """Blocks until every dispatched step has finished."""
        self._in_flight.drain()
