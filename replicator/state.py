"""The train state: everything a step changes, as one pytree."""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import struct


@struct.dataclass
class TrainState:
    """Parameters, optimizer state, step counter and RNG key of a run.

    Attributes:
      step: how many updates have been applied (an int32 array).
      params: the model parameters (stored in the policy's param dtype).
      opt_state: the optimizer's state.
      rng: a `jax.random.key` folded with ``step`` for per-step randomness.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array

    def apply_gradients(self, grads: Any, tx: optax.GradientTransformation) -> TrainState:
        """Returns the state after one optimizer update with ``grads``."""
        updates, opt_state = tx.update(grads, self.opt_state, self.params)
        return self.replace(
            step=self.step + 1,
            params=optax.apply_updates(self.params, updates),
            opt_state=opt_state,
        )
