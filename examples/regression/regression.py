"""Regression with a small MLP: an experiment that lives outside the repository's packages.

``config.experiment = "regression"`` names this module; ``python -m replicator``
imports it from the config file's directory. It has the shape of every
experiment (`experiments/classify/task.py`): host-side ``preprocess``, steps
written once for one replica that return *sums* over their examples, and
``summarize``, which divides them only at the end, so the metrics are exact on
any number of devices and processes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import replicator as rp
from replicator.trainer import ConfigError, Experiment, Settings


class MLP(nn.Module):
    """Dense layers with ReLU, then one linear output per example.

    Attributes:
      hidden: widths of the hidden layers.
      dtype: compute dtype; None follows the inputs and parameters (the precision
        policy sets it).
    """

    hidden: Sequence[int] = (64, 64)
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        x = x_BxF
        for width in self.hidden:
            x = nn.relu(nn.Dense(width, dtype=self.dtype)(x))
        return nn.Dense(1, dtype=self.dtype)(x)[:, 0]


def preprocess(batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The stacked examples as float32 (and the eval batches' ``mask``)."""
    out = {"x": np.asarray(batch["x"], np.float32), "y": np.asarray(batch["y"], np.float32)}
    if "mask" in batch:
        out["mask"] = np.asarray(batch["mask"])
    return out


def make_experiment(settings: Settings) -> Experiment:
    """The regression experiment, from ``config.model`` (`regressor`'s arguments)."""
    return regressor(settings, **settings.model)


def regressor(settings: Settings, *, hidden: Sequence[int] = (64, 64)) -> Experiment:
    """A squared-error regression of ``y`` on ``x``.

    Args:
      settings: from the trainer.
      hidden: widths of the MLP's hidden layers.
    """
    if not hidden or any(int(width) < 1 for width in hidden):
        raise ConfigError(f"config.model.hidden={hidden!r}: give positive layer widths.")
    repl = settings.repl
    model = repl.apply_policy(MLP(tuple(int(width) for width in hidden)))
    tx = settings.make_optimizer()

    def init_state(rng: jax.Array, example: Mapping[str, Any]) -> rp.TrainState:
        init_rng, state_rng = jax.random.split(rng)
        params = model.init(init_rng, jnp.asarray(example["x"])[None])["params"]
        return rp.TrainState.create(
            params, tx, state_rng, policy=repl.precision, grad_accum_steps=settings.grad_accum_steps
        )

    def train_step(state: rp.TrainState, batch):
        def loss_fn(params, batch):
            errors = model.apply({"params": params}, batch["x"]) - batch["y"]
            squared = jnp.square(errors.astype(jnp.float32))
            sums = {
                "squared_error": jnp.sum(squared),
                "absolute_error": jnp.sum(jnp.abs(errors.astype(jnp.float32))),
                "count": jnp.float32(squared.size),
            }
            return rp.compute_average_loss(squared), sums

        (_, sums), grads = state.value_and_grad(loss_fn, batch, has_aux=True)
        return state.apply_gradients(grads, tx), sums

    def eval_step(view, batch):
        errors = (model.apply({"params": view["params"]}, batch["x"]) - batch["y"]).astype(
            jnp.float32
        )
        mask = batch["mask"].astype(jnp.float32)  # padding adds nothing
        return {
            "squared_error": jnp.sum(jnp.square(errors) * mask),
            "absolute_error": jnp.sum(jnp.abs(errors) * mask),
            "count": jnp.sum(mask),
        }

    return Experiment(
        preprocess=preprocess,
        init_state=init_state,
        train_step=train_step,
        eval_step=eval_step,
        summarize=summarize,
        metric_names=("loss", "mae"),
    )


def summarize(sums: Mapping[str, Any]) -> dict[str, float]:
    """Summed errors and count -> ``loss`` (mean squared error) and ``mae``.

    >>> summarize({"squared_error": 2.0, "absolute_error": 3.0, "count": 4.0})
    {'loss': 0.5, 'mae': 0.75}
    """
    count = float(sums["count"])
    mean = lambda key: float(sums[key]) / count if count else math.nan
    return {"loss": mean("squared_error"), "mae": mean("absolute_error")}
