"""Language modelling: next-token prediction with per-token cross-entropy.

Examples are windows of ``block_size + 1`` tokens (``experiments.datasets.text``);
`preprocess` shifts them into ``inputs`` and ``targets``. The loss is the mean
over the real tokens of the global batch, in nats; steps return sums (nats,
tokens), so `summarize` weighs every token exactly once on any number of
devices, batches and processes, and padded eval examples (``mask == 0``) add
nothing.

With ``pack_documents`` a window's documents (each ended by the tokenizer's
``eos_id``) are kept apart: `document_layout` gives every input token its
document (``segment_ids``) and its position in it (``positions``), which the model
attends and embeds by, and a ``target_weights`` of 0 where the target is the next
document's first token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import replicator as rp
from experiments.datasets.text import recorded_tokenizer
from experiments.datasets.tokenizers import Tokenizer, load_tokenizer
from experiments.lm.config import MODEL_OPTIONS, make_model, options_of
from replicator.trainer import ConfigError, Experiment, Settings

METRIC_NAMES = ("loss", "perplexity")
# The weights of a mixture of experts' auxiliary losses (`replicator.parallel.moe.MoEAux`), means
# over the MoE layers, in the training loss: Switch's load balancing and ST-MoE's z-loss.
MOE_BALANCE_WEIGHT = 1e-2
MOE_Z_LOSS_WEIGHT = 1e-3


def make_preprocess(
    max_len: int, separator: int | None = None
) -> Callable[[Mapping[str, Any]], dict[str, np.ndarray]]:
    """Returns ``preprocess(batch)``: ``tokens [B, L + 1]`` -> ``inputs``, ``targets`` ``[B, L]``
    (and with a ``separator``, packed documents, `document_layout`'s ``positions``,
    ``segment_ids`` and ``target_weights``).

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
        out = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:]}
        if separator is not None:
            out.update(document_layout(out["inputs"], separator))
        return out

    return preprocess


def document_layout(inputs_BxL: np.ndarray, separator: int) -> dict[str, np.ndarray]:
    """Where each input token sits among a window's packed documents, each ended by
    ``separator``.

    A document's separator is its own last token: it is predicted (the end of a
    document, as a model that generates one must learn), but predicts nothing, as
    the next document's first token does not follow from the previous document.
    A document cut by the window's start counts its positions from there.

    Returns:
      ``segment_ids`` (int32 ``[B, L]``, counting the documents from 0),
      ``positions`` (int32, restarting at 0 after each separator) and
      ``target_weights`` (float32: 0 where the input is a separator, else 1).

    >>> out = document_layout(np.array([[5, 6, 0, 7, 0, 8]]), separator=0)
    >>> out["segment_ids"].tolist(), out["positions"].tolist()
    ([[0, 0, 0, 1, 1, 2]], [[0, 1, 2, 0, 1, 0]])
    >>> out["target_weights"].tolist()
    [[1.0, 1.0, 0.0, 1.0, 0.0, 1.0]]
    """
    ends_BxL = np.asarray(inputs_BxL) == separator
    segment_ids = np.cumsum(ends_BxL, axis=-1) - ends_BxL  # the separator ends its own
    index_L = np.arange(ends_BxL.shape[-1])
    starts_BxL = np.zeros_like(ends_BxL)
    starts_BxL[..., 0], starts_BxL[..., 1:] = True, ends_BxL[..., :-1]
    first_BxL = np.maximum.accumulate(np.where(starts_BxL, index_L, 0), axis=-1)
    return {
        "segment_ids": segment_ids.astype(np.int32),
        "positions": (index_L - first_BxL).astype(np.int32),
        "target_weights": (~ends_BxL).astype(np.float32),
    }


def document_separator(spec: str) -> int:
    """The id that ends each document for the tokenizer ``spec`` (its ``eos_id``).

    Raises:
      ConfigError: the tokenizer has none (one line).

    >>> document_separator("bytes")
    0
    """
    eos_id = load_tokenizer(spec).eos_id
    if eos_id is None:
        raise ConfigError(
            f"config.pack_documents=True needs a tokenizer that ends documents with an eos "
            f"id, and config.tokenizer={spec!r} has none; set pack_documents=False"
        )
    return eos_id


def token_weights(batch: Mapping[str, jax.Array]) -> jax.Array:
    """1.0 for every token of a real example, 0.0 for padding (``batch["mask"]``, if any)
    and for targets in another document than their input (``batch["target_weights"]``)."""
    ones = jnp.ones_like(batch["targets"], jnp.float32)
    if "target_weights" in batch:
        ones = ones * batch["target_weights"].astype(jnp.float32)
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
    of their `replicator.parallel.moe.MoEAux` (None for a dense one)."""
    moe = bool(getattr(model, "num_experts", None))
    # Packed documents: each token's document and position in it (`document_layout`).
    kwargs.update({key: batch[key] for key in ("positions", "segment_ids") if key in batch})
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


def check_tokenizer(spec: str, dataset: str | None, vocab_size: int) -> Tokenizer:
    """The tokenizer ``spec`` names (`load_tokenizer`), checked against the model's
    vocabulary and the tokenizer ``dataset``'s tokens come from (`recorded_tokenizer`).

    Raises:
      ConfigError: in one line: the tokenizer cannot be read, has more ids than
        ``vocab_size``, or is not the one the data was tokenized with.

    >>> check_tokenizer("bytes", "python_stdlib/modules_128", vocab_size=256).eos_id
    0
    """
    tokenizer = load_tokenizer(spec)
    if vocab_size < tokenizer.vocab_size:
        padded = -(-tokenizer.vocab_size // 128) * 128
        raise ConfigError(
            f"config.model.vocab_size={vocab_size} is smaller than the vocabulary of "
            f"config.tokenizer={spec!r} ({tokenizer.vocab_size} ids); set it to at least "
            f"{tokenizer.vocab_size} (e.g. {padded}, a multiple of 128)"
        )
    recorded = recorded_tokenizer(dataset) if dataset else None
    if recorded is not None and recorded != tokenizer.fingerprint:
        raise ConfigError(
            f"config.dataset={dataset!r} holds the tokens of tokenizer {recorded}, but "
            f"config.tokenizer={spec!r} is {tokenizer.fingerprint}: tokenize the data with "
            "the config's tokenizer (a text dataset's tokenizer=...) or set config.tokenizer "
            "to the data's"
        )
    return tokenizer


def _separator(settings: Settings, options: Mapping[str, Any], vocab_size: int) -> int | None:
    """The id that ends a packed window's documents (None unpacked), the config's tokenizer
    checked first (`check_tokenizer`); a compile (``settings.shapes_only``) reads no
    tokenizer: the id's value changes no shape, and ``vocab_size`` gives the shapes."""
    if settings.shapes_only:
        return 0 if options["pack_documents"] else None
    if "tokenizer" in settings.options:  # a config's: checked before anything is written
        check_tokenizer(options["tokenizer"], settings.dataset, vocab_size)
    return document_separator(options["tokenizer"]) if options["pack_documents"] else None


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
    ``max_len`` tokens per example. The config's tokenizer (``settings.options``'
    ``tokenizer``) must fit ``model.vocab_size`` and be the one the dataset was
    tokenized with (`check_tokenizer`).
    """
    options = options_of(settings)  # the LM's keys (`experiments.lm.config`)
    network = make_model(settings.model, **{key: options[key] for key in MODEL_OPTIONS})
    separator = _separator(settings, options, network.vocab_size)
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
        preprocess=make_preprocess(network.max_len, separator),
        init_state=init_state,
        train_step=train_step,
        eval_step=eval_step,
        summarize=summarize,
        metric_names=METRIC_NAMES,
        units=("tokens", network.max_len),
    )
