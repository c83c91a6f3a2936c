"""An exponential moving average of the parameters, as an optax transformation.

``optax.chain(tx, rp.ema.track(0.999))`` keeps, in the optimizer's state, the
average ``ema = decay * ema + (1 - decay) * new_params`` of the parameters after
every update (it passes the updates through unchanged). Living in the optimizer
state, the average is sharded like the parameters (`replicator.parallel.sharding`'s
state shardings pair each leaf with the parameter whose path it ends with),
updated slice by slice under ZeRO (the update is elementwise), checkpointed with
the rest and restored on resume; a skipped (non-finite) step leaves it as it was.
`with_ema_params` swaps it in for the parameters, e.g. to evaluate it.

>>> import jax.numpy as jnp
>>> tx = optax.chain(optax.sgd(1.0), track(0.5))
>>> params = {"w": jnp.zeros(2)}
>>> state = tx.init(params)
>>> updates, state = tx.update({"w": -jnp.ones(2)}, state, params)   # params -> 1.0
>>> ema_params(state)["w"]
Array([0.5, 0.5], dtype=float32)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any


class EmaState(NamedTuple):
    """The moving average of the parameters (float32, or the parameters' wider dtype)."""

    ema: PyTree


def track(decay: float) -> optax.GradientTransformation:
    """Keeps an EMA of the parameters the updates lead to; the updates pass unchanged.

    Args:
      decay: the weight of the old average, in (0, 1), e.g. 0.999.

    Put it last in a chain, after every transformation that changes the updates,
    so that ``params + updates`` is the new parameters.
    """
    if not 0.0 < decay < 1.0:
        raise ValueError(f"rp.ema.track: decay must be in (0, 1), got {decay}")

    def init_fn(params):  # copies: a donated step must not find one buffer twice
        return EmaState(jax.tree.map(lambda p: jnp.array(p, _wide(p.dtype), copy=True), params))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("rp.ema.track needs the parameters: pass them to tx.update")
        new_params = optax.apply_updates(params, updates)
        ema = jax.tree.map(
            lambda e, p: (decay * e + (1.0 - decay) * p.astype(e.dtype)).astype(e.dtype),
            state.ema,
            new_params,
        )
        return updates, EmaState(ema)

    return optax.GradientTransformation(init_fn, update_fn)


def _wide(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.inexact) else dtype


def _is_state(x: Any) -> bool:
    return isinstance(x, EmaState)


def ema_params(opt_state: PyTree) -> PyTree | None:
    """The average an optimizer state keeps (the first `EmaState` in it), or None."""
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(x)]
    return found[0].ema if found else None


def has_ema(tree: PyTree) -> bool:
    """Whether ``tree`` (a train state, or several) keeps an EMA of parameters."""
    return any(_is_state(x) for x in jax.tree.leaves(tree, is_leaf=_is_state))


def with_ema_params(state: PyTree) -> PyTree:
    """``state`` with every `rp.TrainState`'s parameters replaced by the EMA its optimizer
    state keeps (cast to the parameters' dtype); one that keeps none is left as it is."""
    from replicator.step.state import TrainState

    def swap(x):
        if not isinstance(x, TrainState):
            return x
        ema = ema_params(x.opt_state)
        if ema is None:
            return x
        return x.replace(params=jax.tree.map(_cast_like, ema, x.params))

    is_state = lambda x: isinstance(x, TrainState)
    return jax.tree.map(swap, state, is_leaf=is_state)


def restart(state: PyTree) -> PyTree:
    """``state`` with every EMA its `rp.TrainState`s keep set to their parameters, e.g.
    after loading parameters from elsewhere (fine-tuning), so that the average starts
    from them rather than from the initialisation it was created from."""
    from replicator.step.state import TrainState

    def from_params(x):
        if not isinstance(x, TrainState) or ema_params(x.opt_state) is None:
            return x

        def reset(node):
            if not _is_state(node):
                return node
            # (Copies: a donated step must not find one buffer twice.)
            ema = jax.tree.map(lambda e, p: jnp.array(p, e.dtype, copy=True), node.ema, x.params)
            return EmaState(ema)

        return x.replace(opt_state=jax.tree.map(reset, x.opt_state, is_leaf=_is_state))

    return jax.tree.map(from_params, state, is_leaf=lambda x: isinstance(x, TrainState))


def _cast_like(e: Any, p: Any) -> Any:
    """``e`` in ``p``'s dtype where both are arrays (not abstract ones, or labels)."""
    if isinstance(e, jax.Array) and hasattr(p, "dtype") and e.dtype != p.dtype:
        return e.astype(p.dtype)
    return e
