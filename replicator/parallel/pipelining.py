"""Pipeline parallelism (`rp.pipeline`): a stack of identical layers over the axis ``stage``.

`pipeline` runs ``L`` layers whose parameters are stacked on a leading axis (the
layout of a scanned model, e.g. ``nn.scan``'s ``params/blocks/...``) as a GPipe
schedule over ``S`` stages, or a circular one (MaxText's
``num_pipeline_repeats``) when ``repeats > 1``:

* the batch is cut into ``M`` microbatches; stage ``s`` runs its layers on one
  microbatch per iteration and passes the result to stage ``s + 1`` with
  ``ppermute`` (a ``collective-permute`` in the HLO), so after ``S - 1``
  iterations every stage is busy;
* with ``repeats = R``, layer ``l`` belongs to stage ``(l // lps) % S`` where
  ``lps = L / (S * R)``: each microbatch goes round the ring of stages ``R``
  times, and the last stage's output re-enters stage 0 (kept there until its
  turn when ``M > S``);
* the schedule takes ``M * R + S - 1`` iterations, of which each stage idles
  ``S - 1`` (the bubble): ``(S - 1) / (M * R + S - 1)`` of the time.

The backward pass is JAX's transpose of this program (the ``ppermute``s reversed):
nothing here is written twice. Each iteration's work can be rematerialised with
a policy of `replicator.step.remat`.

It runs under `Replicator.compile` (the global view: it goes manual over
``stage`` only, in a ``shard_map``, and leaves every other axis to the compiler)
and under `Replicator.run` (where ``stage`` is left to the compiler likewise, or
is manual already), and with no ``stage`` axis, or one of size 1, it is a plain
loop over the layers: the same numbers, so a model built on it runs, saves and
restores the same on any number of stages. The parameters stay ``[L, ...]`` in
the training state and in checkpoints whatever the schedule; only a circular
schedule reorders them (an all-to-all over ``stage`` per step) into the order it
runs them in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from replicator.errors import ConfigError
from replicator.parallel import axes as mesh_axes
from replicator.parallel.activations import batch_axes
from replicator.spmd.context import vary, varying_axes
from replicator.step import remat as remat

PyTree = Any
STAGE_AXIS = "stage"


def pipeline(
    layer_fn: Callable[[PyTree, jax.Array], jax.Array],
    stacked_params: PyTree,
    x: jax.Array,
    *,
    microbatches: int,
    repeats: int = 1,
    remat_policy: str | None = None,
    axis: str = STAGE_AXIS,
) -> jax.Array:
    """Applies ``L`` layers to ``x``, pipelined over the mesh axis ``axis``.

    Equal to ``for l in range(L): x = layer_fn(params[l], x)`` (up to the order of
    float sums), for any number of stages.

    Args:
      layer_fn: one layer, ``(layer_params, h) -> h`` with ``h`` shaped like ``x``;
        it must treat each example of the batch on its own (as a transformer
        block does), since it sees one microbatch at a time.
      stacked_params: the layers' parameters, every leaf stacked on a leading
        axis of size ``L``.
      x: the input, batch first.
      microbatches: how many pieces the batch is cut into (``M``): at least the
        number of stages; more shrink the bubble.
      repeats: ``R``: 1 for GPipe, more for a circular schedule.
      remat_policy: a policy of `replicator.step.remat` applied to each stage's work
        per iteration (None keeps everything).
      axis: the mesh axis the stages span.

    Returns:
      The output of the last layer, shaped like ``x``, on every stage.

    Raises:
      ConfigError: (a ``ValueError``) a stack whose leaves disagree on ``L``, ``L``
        not divisible by stages x repeats, fewer microbatches than stages, or a
        batch not divisible by the microbatches: each one line naming the fix,
        which the trainer's command line prints as such.

    >>> params = {"w": jnp.ones((4, 3, 3)) / 3}
    >>> pipeline(lambda p, h: h @ p["w"], params, jnp.ones((2, 3)), microbatches=2).shape
    (2, 3)
    """
    stages = stage_count(axis)
    manual = stages > 1 and mesh_axes.is_manual(axis)  # inside a shard_map over ``axis`` already
    split = manual and _varies(stacked_params, axis)  # each stage holds [L / S, ...]
    layers = _num_layers(stacked_params) * (stages if split else 1)
    _check(layers, stages, repeats, microbatches, x.shape[0])
    if stages == 1:
        return _layers(layer_fn, remat_policy)(stacked_params, x)
    schedule = _Schedule(stages, repeats, microbatches, layer_fn, remat_policy, axis)
    if manual:
        return schedule.run_local(stacked_params, x, split=split)
    mesh = jax.sharding.get_abstract_mesh()
    # Manual over the batch's axes too, where a microbatch splits over them: each device
    # runs its rows of every microbatch, the parameters enter gathered over them once,
    # and their gradients leave summed once per step, not once per iteration.
    rows = batch_axes(mesh, x.shape[0] // microbatches, exclude=axis)
    # Each stage leaves with its share of the output rows, which the layers after
    # the stack (a head, a loss) then split over the stages too: a reduce-scatter of
    # the last stage's output rather than an all-reduce to every stage.
    local = x.shape[0] // math.prod(mesh.shape[a] for a in rows)
    scatter = (local // microbatches) % stages == 0
    by_stage = jax.tree.map(lambda p: _by_stage(p, stages, repeats), stacked_params)
    program = jax.shard_map(
        # Typed varying over the batch axes on entry: autodiff then sums their gradients
        # over those axes once, as the pipeline ends, not in every iteration that uses them.
        lambda params, x: schedule(jax.tree.map(lambda p: vary(p[0], rows), params), x, scatter),
        mesh=mesh,
        in_specs=(P(axis), P(rows or None)),
        out_specs=P((*rows, axis)) if scatter else P(rows or None),
        axis_names=frozenset({axis, *rows}),
        check_vma=True,
    )
    return program(by_stage, x)


def stage_count(axis: str = STAGE_AXIS) -> int:
    """The number of pipeline stages: the size of ``axis`` in the mesh being traced for
    (`replicator.parallel.axes.size`; 1 without one)."""
    return mesh_axes.size(axis)


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The fraction of a stage's iterations that are idle: ``(S-1) / (M*R + S-1)``.

    >>> bubble_fraction(4, 8)
    0.2727272727272727
    """
    return (stages - 1) / (microbatches * repeats + stages - 1)


class _Schedule:
    """The per-stage program: ``M * R + S - 1`` iterations of one stage's layers on one
    microbatch, the result passed on with ``ppermute``."""

    def __init__(self, stages, repeats, microbatches, layer_fn, policy, axis):
        self.S, self.R, self.M, self.axis = stages, repeats, microbatches, axis
        self.layers = _layers(layer_fn, policy)

    def run_local(self, stack: PyTree, x: jax.Array, *, split: bool) -> jax.Array:
        """With ``axis`` manual: ``stack`` is this stage's contiguous ``[L / S, ...]``
        (``split``) or the whole ``[L, ...]``."""
        S, R, axis = self.S, self.R, self.axis
        if split and R == 1:  # a contiguous slice is exactly this stage's layers
            return self(jax.tree.map(lambda p: p[None], stack), x)
        if split:  # a circular schedule runs every S-th block of layers here
            stack = jax.tree.map(lambda p: jax.lax.all_gather(p, axis, tiled=True), stack)
        s = jax.lax.axis_index(axis)
        return self(jax.tree.map(lambda p: _at(_by_stage(p, S, R), s), stack), x)

    def __call__(self, params: PyTree, x: jax.Array, scatter: bool = False) -> jax.Array:
        """``params``: this stage's ``[R, lps, ...]``; ``x``: this device's rows of the
        batch. Returns the last layer's output of those rows on every stage, or with
        ``scatter`` each stage's ``1 / S`` of them (the rows ``[s * B / S, ...)``)."""
        S, R, M, axis = self.S, self.R, self.M, self.axis
        s = jax.lax.axis_index(axis)
        # Microbatch m holds rows m, m + M, m + 2M, ...: a stage's share of every
        # microbatch's output (`scatter`) is then a contiguous block of the rows.
        micro = jnp.swapaxes(x.reshape(x.shape[0] // M, M, *x.shape[1:]), 0, 1)
        micro = vary(micro, (axis,))  # its gradient summed over the stages once, not per use
        zeros = vary(jnp.zeros_like(micro), (axis,))
        ring = [(j, (j + 1) % S) for j in range(S)]

        def iteration(carry, t):
            h, circ, out = carry
            i = jnp.clip(t - s, 0, M * R - 1)  # the (microbatch, repeat) this stage is on
            valid = (t - s >= 0) & (t - s < M * R)
            m, r = i % M, i // M
            fresh = jax.lax.dynamic_index_in_dim(micro, m, keepdims=False)
            if R > 1:  # later rounds start from what the last stage passed back
                fresh = jnp.where(r == 0, fresh, _at(circ, m))
            y = self.layers(jax.tree.map(lambda p: _at(p, r), params), jnp.where(s == 0, fresh, h))
            done = valid & (s == S - 1) & (r == R - 1)
            out = jax.lax.dynamic_update_index_in_dim(out, jnp.where(done, y, _at(out, m)), m, 0)
            passed = jax.lax.ppermute(y, axis, ring if R > 1 else ring[:-1])
            if R > 1:  # stage 0 keeps what came back from the last stage until its turn
                back = t - (S - 1)
                mb = jnp.clip(back, 0, M * R - 1) % M
                keep = (s == 0) & (back >= 0) & (back < M * R)
                circ = jax.lax.dynamic_update_index_in_dim(
                    circ, jnp.where(keep, passed, _at(circ, mb)), mb, 0
                )
            return (passed, circ, out), None

        carry = (zeros[0], zeros if R > 1 else zeros[:0], zeros)
        (_, _, out), _ = jax.lax.scan(iteration, carry, jnp.arange(M * R + S - 1))
        # Only the last stage's is not 0: summed to every stage, or each stage its share.
        if scatter:
            out = jax.lax.psum_scatter(out, axis, scatter_dimension=1, tiled=True)
        else:
            out = jax.lax.psum(out, axis)
        return jnp.swapaxes(out, 0, 1).reshape(-1, *x.shape[1:])


def _layers(layer_fn: Callable, policy: str | None) -> Callable:
    """``(stack, h) -> h``: ``layer_fn`` over a stack's layers in order, each stack's
    work rematerialised under ``policy``."""

    def apply(stack, h):
        h, _ = jax.lax.scan(lambda h, p: (layer_fn(p, h), None), h, stack)
        return h

    if policy is None:
        return apply
    return jax.checkpoint(apply, policy=remat.checkpoint_policy(policy))


def _at(tree_leaf: jax.Array, index) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(tree_leaf, index, keepdims=False)


def _by_stage(p: jax.Array, stages: int, repeats: int) -> jax.Array:
    """``[L, ...]`` -> ``[S, R, lps, ...]``: layer ``(r * S + s) * lps + j`` at ``[s, r, j]``."""
    lps = p.shape[0] // (stages * repeats)
    p = p.reshape(repeats, stages, lps, *p.shape[1:])
    return jnp.swapaxes(p, 0, 1)


def _varies(stack: PyTree, axis: str) -> bool:
    """Whether the (manual) ``axis`` splits ``stack``: its leaves differ per stage."""
    return all(varying_axes(p, (axis,)) for p in jax.tree.leaves(stack))


def _num_layers(stack: PyTree) -> int:
    sizes = {leaf.shape[0] if leaf.ndim else None for leaf in jax.tree.leaves(stack)}
    if len(sizes) != 1 or None in sizes:
        raise ConfigError(
            f"pipeline: the stacked parameters must all have the same leading (layer) "
            f"axis; their leading sizes are {sorted(sizes, key=str)}. Stack identical "
            f"layers (e.g. with nn.scan) to pipeline them."
        )
    return sizes.pop()


def _check(layers: int, stages: int, repeats: int, microbatches: int, batch: int) -> None:
    if repeats < 1 or microbatches < 1:
        raise ConfigError(
            f"pipeline: repeats ({repeats}) and microbatches ({microbatches}) must be >= 1."
        )
    if layers % (stages * repeats):
        raise ConfigError(
            f"pipeline: {layers} layers do not split over {stages} stages x {repeats} "
            f"repeats; choose a number of layers divisible by {stages * repeats}, or "
            f"fewer stages or repeats."
        )
    if stages > 1 and microbatches < stages:
        raise ConfigError(
            f"pipeline: {microbatches} microbatches for {stages} stages leaves stages "
            f"idle; set pipeline_microbatches to at least {stages}."
        )
    if batch % microbatches:
        raise ConfigError(
            f"pipeline: a batch of {batch} does not split into {microbatches} "
            f"microbatches; choose a number of microbatches that divides it."
        )
