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
# The weights of a mixture of experts' auxiliary losses (`replicator.moe.MoEAux`), means
# over the MoE layers, in the training loss: Switch's load balancing and ST-MoE's z-loss.
MOE_BALANCE_WEIGHT = 1e-2
MOE_Z_LOSS_WEIGHT = 1e-3


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
    return nats_and_moe_aux(model, params, batch, **kwargs)[0]


def nats_and_moe_aux(
    model: Any, params: Any, batch: Mapping[str, jax.Array], **kwargs
) -> tuple[jax.Array, Any]:
    """`token_nats` and, for a mixture-of-experts model, the mean over its MoE layers
    of their `replicator.moe.MoEAux` (None for a dense one)."""
    moe = bool(getattr(model, "num_experts", None))
    out = model.apply(
        {"params": params}, batch["inputs"], targets=batch["targets"],
        mutable=["intermediates"] if moe else False, **kwargs,
    )  # fmt: skip
    nats_BxL, aux = (out[0], _mean_moe_aux(out[1])) if moe else (out, None)
    return nats_BxL.astype(jnp.promote_types(nats_BxL.dtype, jnp.float32)), aux


def _mean_moe_aux(variables: Mapping[str, Any]) -> rp.moe.MoEAux:
    """The sown `MoEAux` of every MoE layer (stacked by the scan or not), averaged."""
    is_aux = lambda x: isinstance(x, rp.moe.MoEAux)  # noqa: E731
    found = jax.tree.leaves(variables.get("intermediates", {}), is_leaf=is_aux)
    found = [x for x in found if is_aux(x)]
    return rp.moe.MoEAux(*(jnp.mean(jnp.stack([jnp.ravel(v) for v in vs])) for vs in zip(*found)))


def summarize(sums: Mapping[str, Any]) -> dict[str, float]:
    """Nats and tokens summed over a run's batches -> ``loss`` (nats/token), ``perplexity``.

    >>> metrics = summarize({"loss": np.float32(6.0), "tokens": np.float32(4.0)})
    >>> metrics["loss"], round(metrics["perplexity"], 4)
    (1.5, 4.4817)
    """
    tokens = float(sums["tokens"])
    loss = float(sums["loss"]) / tokens if tokens else math.nan
    metrics = {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf}
    if "dropped" in sums:  # a mixture of experts' training steps
        metrics["dropped_fraction"] = float(sums["dropped"]) / tokens if tokens else math.nan
    return metrics


def make_model(
    model_kwargs: Mapping[str, Any], remat_policy: str | None = None, **parallel: Any
) -> Transformer:
    """The `Transformer` from the config's ``model`` dict, ``remat_policy`` and
    ``pipeline_microbatches`` / ``pipeline_repeats`` / ``context_strategy`` /
    ``context_load_balance``."""
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
        return Transformer(**model_kwargs, remat_policy=remat_policy, **parallel)
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
    ``perplexity = exp(loss)``; a mixture-of-experts model's train records also
    ``dropped_fraction`` (token-choice pairs over capacity) and its training loss
    adds ``MOE_BALANCE_WEIGHT`` x the load-balancing loss and ``MOE_Z_LOSS_WEIGHT`` x
    the router z-loss (means over the MoE layers, each over the whole batch's tokens
    on both step paths, as on one device); throughput counts
    ``max_len`` tokens per example.
    """
    network = make_model(
        settings.model,
        settings.remat_policy,
        pipeline_microbatches=settings.pipeline_microbatches,
        pipeline_repeats=settings.pipeline_repeats,
        context_strategy=settings.context_strategy,
        context_load_balance=settings.context_load_balance,
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
            nats, aux = nats_and_moe_aux(
                model, params, batch, train=True, rngs={"dropout": dropout_rng}
            )
            loss = rp.compute_average_loss(
                nats, global_batch_size=total_tokens, sample_weight=weights
            )
            sums = {"loss": jnp.sum(nats * weights), "tokens": jnp.sum(weights)}
            if aux is not None:  # each call's aux, weighed by its share of the tokens
                share = sums["tokens"] / total_tokens
                extra = MOE_BALANCE_WEIGHT * aux.load_balance_loss
                loss = loss + share * (extra + MOE_Z_LOSS_WEIGHT * aux.router_z_loss)
                sums["dropped"] = aux.dropped_fraction * sums["tokens"]
            return loss, sums

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
