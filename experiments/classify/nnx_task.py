"""Image classification with a Flax NNX model: the NNX MNIST tutorial's CNN in the trainer.

The same task as `task.py` (its preprocessing, sums and metrics) with the model
written in NNX. The trainer's state is a pytree, so the module lives in
`rp.TrainState` as the two halves of ``nnx.split(model, nnx.Param, ...)``:
``params`` is the `nnx.State` of its `nnx.Param` variables (what the optimizer
updates, stored in the policy's parameter dtype) and ``model_state`` the rest
(BatchNorm statistics; RNG state, had the module any), so checkpoints save both
and ``eval`` restores them onto any device count. Each step merges a module from
them, calls it, and splits its new state back out: the graph definition is
static, built once per image shape.

Written once, per replica, for `Replicator.run` and `Replicator.compile`:
BatchNorm takes ``axis_name=repl.axis_name`` (statistics of the global batch
either way), dropout draws from ``nnx.Rngs(dropout=rp.replica_key(...))`` (each
replica its own mask) and the precision policy wraps the merged module
(`rp.apply_policy`), so the checkpoint's structure is the same in every
precision.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import replicator as rp
from experiments.classify.nnx_model import CNN
from experiments.classify.task import eval_sums, preprocess, summarize
from replicator.trainer import ConfigError, Experiment, Settings


def make_experiment(settings: Settings) -> Experiment:
    """The NNX classification experiment, from ``config.model`` (`classifier`'s arguments)."""
    return classifier(settings, **settings.model)


def classifier(
    settings: Settings,
    *,
    arch: str = "nnx_cnn",
    num_classes: int = 10,
    conv_features: Sequence[int] = (32, 64),
    hidden_features: int = 256,
    dropout_rate: float = 0.025,
) -> Experiment:
    """The classification experiment with the NNX tutorial's CNN.

    Args:
      settings: from the trainer.
      arch: ``"nnx_cnn"``, the only NNX architecture.
      num_classes, conv_features, hidden_features, dropout_rate: the CNN's
        (`experiments.classify.nnx_model.CNN`).
    """
    if arch != "nnx_cnn":
        raise ConfigError(f"config.model.arch={arch!r}: the NNX experiment has only 'nnx_cnn'.")

    def make_model(image_shape: Sequence[int], rng: jax.Array) -> CNN:
        return CNN(
            tuple(image_shape),
            num_classes=num_classes,
            conv_features=tuple(conv_features),
            hidden_features=hidden_features,
            dropout_rate=dropout_rate,
            axis_name=settings.repl.axis_name,
            rngs=nnx.Rngs(params=rng),
        )

    return _experiment(make_model, settings)


def _experiment(
    make_model: Callable[[Sequence[int], jax.Array], CNN], settings: Settings
) -> Experiment:
    """The experiment around an NNX classifier; ``make_model(image_shape, rng)`` builds it."""
    repl, tx = settings.repl, settings.make_optimizer()

    @functools.cache
    def graphdef(image_shape: tuple[int, ...]) -> nnx.GraphDef:
        abstract = nnx.eval_shape(lambda: make_model(image_shape, jax.random.key(0)))
        return nnx.graphdef(abstract)

    def merge(params, model_state, images) -> CNN:
        # Copies: the state's own Variables must not change, nor be traced at another level.
        return nnx.merge(graphdef(images.shape[1:]), params, model_state, copy=True)

    def init_state(rng: jax.Array, example) -> rp.TrainState:
        init_rng, state_rng = jax.random.split(rng)
        _, params, model_state = nnx.split(make_model(example["image"].shape, init_rng),
                                           nnx.Param, ...)  # fmt: skip
        return rp.TrainState.create(
            params,
            tx,
            state_rng,
            model_state=model_state,
            policy=repl.precision,
            grad_accum_steps=settings.grad_accum_steps,
        )

    def train_step(state: rp.TrainState, batch):
        dropout_key = rp.replica_key(jax.random.fold_in(state.rng, state.step))

        def loss_fn(params, model_state, batch):
            model = merge(params, model_state, batch["image"])
            logits = repl.apply_policy(model)(batch["image"], nnx.Rngs(dropout=dropout_key))
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
            sums = {
                "loss": jnp.sum(losses),
                "correct": jnp.sum(jnp.argmax(logits, -1) == batch["label"]),
                "count": jnp.float32(losses.size),
            }
            _, _, new_model_state = nnx.split(model, nnx.Param, ...)  # statistics moved
            return rp.compute_average_loss(losses), (new_model_state, sums)

        (_, (model_state, sums)), grads = state.value_and_grad(loss_fn, batch, has_aux=True)
        return state.apply_gradients(grads, tx, model_state=model_state), sums

    def eval_step(view, batch):
        model = merge(view["params"], view["model_state"], batch["image"])
        model = nnx.view(model, deterministic=True, use_running_average=True)
        return eval_sums(repl.apply_policy(model)(batch["image"]), batch)

    return Experiment(
        preprocess=preprocess,
        init_state=init_state,
        train_step=train_step,
        eval_step=eval_step,
        summarize=summarize,
        metric_names=("accuracy", "loss"),
    )
