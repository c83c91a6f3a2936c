"""Language modelling: next-token prediction with per-token cross-entropy.

Examples are windows of ``block_size + 1`` tokens (``experiments.datasets.text``);
`preprocess` shifts them into ``inputs`` and ``targets``. The loss is the mean
over the real tokens of the global batch, in nats; steps return sums (nats,
tokens), so `summarize` weighs every token exactly once on any number of
devices, batches and processes, and padded eval examples (``mask == 0``) add
nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import replicator as rp
from experiments.lm.model import Transformer
from replicator.trainer import ConfigError, Experiment, Settings

METRIC_NAMES = ("loss", "perplexity")


def make_preprocess(max_len: int) -> Callable[[Mapping[str, Any]], dict[str, np.ndarray]]:
    """Returns ``preprocess(batch)``: ``tokens [B, L + 1]`` -> ``inputs``, ``targets`` ``[B, L]``.

    Raises (when called) a `ConfigError` if ``L > max_len``: the dataset's windows
    are longer than the model's context.

    >>> preprocess = make_preprocess(max_len=3)
    >>> out = preprocess({"tokens": np.array([[1, 2, 3, 4]])})
    >>> out["inputs"].tolist(), out["targets"].tolist()
    ([[1, 2, 3]], [[2, 3, 4]])
    """

    def preprocess(batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
        tokens = np.asarray(batch["tokens"], np.int32)
        if tokens.shape[-1] - 1 > max_len:
            raise ConfigError(
                f"the dataset's windows hold {tokens.shape[-1] - 1} tokens, above "
                f"config.model.max_len={max_len}; raise max_len or use shorter windows "
                "(the dataset's block_size)."
            )
        return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:]}

    return preprocess


def token_weights(batch: Mapping[str, jax.Array]) -> jax.Array:
    """1.0 for every token of a real example, 0.0 for padding (``batch["mask"]``, if any)."""
    ones = jnp.ones_like(batch["targets"], jnp.float32)
    if "mask" not in batch:
        return ones
    return ones * batch["mask"].astype(jnp.float32)[:, None]


def token_nats(model: Any, params: Any, batch: Mapping[str, jax.Array], **kwargs) -> jax.Array:
    """Per-token cross-entropy ``[B, L]`` of ``model``'s next-token predictions, in nats
    (the model computes it: in chunks of the sequence with ``loss_chunk``)."""
    nats_BxL = model.apply({"params": params}, batch["inputs"], targets=batch["targets"], **kwargs)
    return nats_BxL.astype(jnp.promote_types(nats_BxL.dtype, jnp.float32))


def summarize(sums: Mapping[str, Any]) -> dict[str, float]:
    """Nats and tokens summed over a run's batches -> ``loss`` (nats/token), ``perplexity``.

    >>> metrics = summarize({"loss": np.float32(6.0), "tokens": np.float32(4.0)})
    >>> metrics["loss"], round(metrics["perplexity"], 4)
    (1.5, 4.4817)
    """
    tokens = float(sums["tokens"])
    loss = float(sums["loss"]) / tokens if tokens else math.nan
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf}


def make_model(
    model_kwargs: Mapping[str, Any], remat_policy: str | None = None, **pipeline: Any
) -> Transformer:
    """The `Transformer` from the config's ``model`` dict, ``remat_policy`` and
    ``pipeline_microbatches`` / ``pipeline_repeats``."""
    if "warmup_steps" in model_kwargs:
        raise ConfigError(
            "config.model.warmup_steps is a config key of its own now: config.warmup_steps "
            "(with config.lr_schedule='cosine', config.lr_end_fraction=0.1 as before)"
        )
    if "remat" in model_kwargs or "remat_policy" in model_kwargs:
        raise ConfigError(
            "config.model.remat is config.remat_policy now: None (keep every activation), "
            "'full' (what remat=True was), 'minimal', 'save_dot_except_mlp', 'save_qkv_proj' "
            "or 'minimal_offloaded'"
        )
    try:
        return Transformer(**model_kwargs, remat_policy=remat_policy, **pipeline)
    except ValueError as e:  # the model's own checks of its sizes
        raise ConfigError(f"config.model: {e}") from None
    except TypeError as e:
        known = sorted(
            f.name
            for f in Transformer.__dataclass_fields__.values()
            if f.name not in ("parent", "name")
        )
        raise ConfigError(
            f"config.model has a key the LM does not take ({e}); known: {known}."
        ) from None


def make_experiment(settings: Settings) -> Experiment:
    """The language-modelling `Experiment` for the trainer.

    ``settings.model`` holds `Transformer`'s keyword arguments; the learning rate's
    schedule is the config's (``lr_schedule``, ``warmup_steps``).

    Train records and eval records report ``loss`` (nats per real token) and
    ``perplexity = exp(loss)``; throughput counts ``max_len`` tokens per example.
    """
    network = make_model(
        settings.model,
        settings.remat_policy,
        pipeline_microbatches=settings.pipeline_microbatches,
        pipeline_repeats=settings.pipeline_repeats,
    )
    model = settings.repl.apply_policy(network)
    tx = settings.make_optimizer()

    def init_state(rng: jax.Array, example: Mapping[str, Any]) -> rp.TrainState:
        init_rng, state_rng = jax.random.split(rng)
        inputs = jnp.asarray(example["inputs"])[None]
        params = model.init(init_rng, inputs)["params"]
        return rp.TrainState.create(
            params,
            tx,
            state_rng,
            policy=settings.repl.precision,
            grad_accum_steps=settings.grad_accum_steps,
        )

    def train_step(state: rp.TrainState, batch: Mapping[str, jax.Array]):
        total_tokens = rp.global_sum(token_weights(batch))  # over every replica and microbatch
        dropout_rng = rp.replica_key(jax.random.fold_in(state.rng, state.step))

        def loss_fn(params, batch):
            weights = token_weights(batch)
            nats = token_nats(model, params, batch, train=True, rngs={"dropout": dropout_rng})
            loss = rp.compute_average_loss(
                nats, global_batch_size=total_tokens, sample_weight=weights
            )
            return loss, {"loss": jnp.sum(nats * weights), "tokens": jnp.sum(weights)}

        (_, sums), grads = state.value_and_grad(loss_fn, batch, has_aux=True)
        return state.apply_gradients(grads, tx), sums

    def eval_step(eval_state: Mapping[str, Any], batch: Mapping[str, jax.Array]):
        weights = token_weights(batch)
        nats = token_nats(model, eval_state["params"], batch)
        # where, not a product: padding never contributes, even as 0 * inf.
        return {"loss": jnp.sum(jnp.where(weights > 0, nats, 0.0)), "tokens": jnp.sum(weights)}

    return Experiment(
        preprocess=make_preprocess(network.max_len),
        init_state=init_state,
        train_step=train_step,
        eval_step=eval_step,
        summarize=summarize,
        metric_names=METRIC_NAMES,
        units=("tokens", network.max_len),
    )
