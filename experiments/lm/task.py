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
from experiments.lm import preference
from experiments.lm.config import MODEL_OPTIONS, PREFERENCE_OBJECTIVES, make_model, options_of
from replicator.trainer import ConfigError, Experiment, Settings

METRIC_NAMES = ("loss", "perplexity", "bits_per_byte")
REFERENCE = "reference"  # params/reference/: the DPO reference's weights, without LoRA


def make_preprocess(
    max_len: int, separator: int | None = None, objective: str = "lm"
) -> Callable[[Mapping[str, Any]], dict[str, np.ndarray]]:
    """Returns ``preprocess(batch)``: ``tokens [B, L + 1]`` -> ``inputs``, ``targets`` ``[B, L]``
    (and with a ``separator``, packed documents, `document_layout`'s ``positions``,
    ``segment_ids`` and ``target_weights``; for conversation and preference data, whose
    examples carry ``segments`` and ``loss_mask``, `segment_layout`'s).

    Raises (when called) a `ConfigError` if ``L > max_len``: the dataset's windows
    are longer than the model's context; or if ``objective`` needs a loss mask
    (``sft``, the preference losses) that the data does not carry.

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
        if "segments" in batch:  # conversations or preference pairs, laid out by the data
            out.update(segment_layout(batch["segments"], batch["loss_mask"], objective))
        elif objective != "lm":
            raise ConfigError(
                f"config.objective={objective!r} trains on the tokens a dataset marks (its "
                "loss_mask): use a chat/... (sft) or preferences/... dataset"
            )
        elif separator is not None:
            out.update(document_layout(out["inputs"], separator))
        return out

    return preprocess


def segment_layout(
    segments_BxL: np.ndarray, loss_mask_BxL: np.ndarray, objective: str = "sft"
) -> dict[str, np.ndarray]:
    """Inputs and targets of windows whose tokens carry their sequence (``segments``,
    ``[B, L + 1]``, 0 for padding) and whether each is trained on (``loss_mask``), as
    ``chat/`` and ``preferences/`` data lay them out.

    Returns:
      ``segment_ids`` and ``positions`` of the inputs (positions restart with each
      sequence: a packed sequence is computed as it is alone), ``target_weights``
      (1 where the target follows its input in the same sequence and, but for
      ``objective='lm'``, is marked by the loss mask) and, for the preference
      objectives, ``target_segments`` (each weighted target's sequence, else 0).

    >>> out = segment_layout(np.array([[1, 1, 1, 2, 2, 0]]), np.array([[0, 0, 1, 0, 1, 0]]))
    >>> out["positions"].tolist(), out["target_weights"].tolist()
    ([[0, 1, 2, 0, 1]], [[0.0, 1.0, 0.0, 1.0, 0.0]])
    """
    segments_BxL = np.asarray(segments_BxL, np.int32)
    inputs, targets = segments_BxL[..., :-1], segments_BxL[..., 1:]
    same = (inputs == targets) & (targets > 0)
    marked = np.asarray(loss_mask_BxL)[..., 1:] > 0
    weights = same if objective == "lm" else same & marked
    index = np.arange(inputs.shape[-1])
    starts = np.ones_like(inputs, bool)
    starts[..., 1:] = inputs[..., 1:] != inputs[..., :-1]
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=-1)
    out = {
        "segment_ids": inputs,
        "positions": (index - first).astype(np.int32),
        "target_weights": weights.astype(np.float32),
    }
    if objective in PREFERENCE_OBJECTIVES:
        out["target_segments"] = np.where(weights, targets, 0).astype(np.int32)
    return out


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
    nats_BxL, aux = (out[0], _mean_moe_aux(out[1], model)) if moe else (out, None)
    return nats_BxL.astype(jnp.promote_types(nats_BxL.dtype, jnp.float32)), aux


def _mean_moe_aux(variables: Mapping[str, Any], model: Any = None) -> rp.moe.MoEAux:
    """The sown `MoEAux` of every MoE layer (stacked by the scan or not), averaged; with
    the model key ``moe_balance_pooled``, the balancing loss of all their routing pooled."""
    is_aux = lambda x: isinstance(x, rp.moe.MoEAux)  # noqa: E731
    found = jax.tree.leaves(variables.get("intermediates", {}), is_leaf=is_aux)
    found = [x for x in found if is_aux(x)]
    aux = rp.moe.MoEAux(*(jnp.mean(jnp.stack([jnp.ravel(v) for v in vs])) for vs in zip(*found)))
    if getattr(model, "moe_balance_pooled", False):
        aux = aux._replace(load_balance_loss=_pooled_balance(variables, model))
    return aux


def _pooled_balance(variables: Mapping[str, Any], model: Any) -> jax.Array:
    """The load-balancing loss of every MoE layer's tokens routed together (their sown
    router logits as one batch, `rp.moe.route`): transformers' ``load_balancing_loss_func``
    over ``k``, which pools the layers' statistics before the product."""
    leaves = jax.tree_util.tree_leaves_with_path(variables["intermediates"])
    logits = [x for path, x in leaves if "router_logits" in jax.tree_util.keystr(path)]
    pooled = jnp.concatenate([x.reshape(-1, *x.shape[-2:]) for x in logits])
    routing = rp.moe.route(
        pooled, experts_per_token=model.experts_per_token, capacity=None,
        routing=model.expert_routing,
    )  # fmt: skip
    return routing.aux.load_balance_loss


def summarize(sums: Mapping[str, Any]) -> dict[str, float]:
    """Nats and tokens summed over a run's batches -> ``loss`` (nats/token), ``perplexity``,
    and where the bytes of text they stand for were summed (eval), ``bits_per_byte``: the
    nats in bits over those bytes, lm-eval-harness's tokenizer-free measure.

    >>> metrics = summarize({"loss": np.float32(6.0), "tokens": np.float32(4.0)})
    >>> metrics["loss"], round(metrics["perplexity"], 4)
    (1.5, 4.4817)
    >>> round(summarize({"loss": 6.0, "tokens": 4.0, "bytes": 12.0})["bits_per_byte"], 4)
    0.7213
    """
    tokens = float(sums["tokens"])
    loss = float(sums["loss"]) / tokens if tokens else math.nan
    metrics = {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf}
    if "bytes" in sums:
        num_bytes = float(sums["bytes"])
        metrics["bits_per_byte"] = (
            float(sums["loss"]) / math.log(2) / num_bytes if num_bytes else math.nan
        )
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

    ``objective`` (`experiments.lm.config.OPTIONS`) picks the loss: ``lm`` and ``sft``
    train on next-token prediction (`lm_steps`: ``sft`` on the tokens a ``chat/``
    dataset marks, its assistant turns, whose count the train records report as
    ``trained_tokens``); ``dpo``, ``ipo`` and ``simpo`` on preference pairs
    (`preference_steps`). Under LoRA (``model.lora_rank``) the base weights are frozen
    (`frozen_parameters`) and a preference loss's reference is the base without the
    adapters; without LoRA, ``dpo`` and ``ipo`` keep a frozen copy of the starting
    weights as ``params/reference/`` (one more copy of the parameters, no optimizer
    state, no backward pass; one more forward pass a step).

    The config's tokenizer (``settings.options``' ``tokenizer``) must fit
    ``model.vocab_size`` and be the one the dataset was tokenized with
    (`check_tokenizer`); throughput counts ``max_len`` tokens per example.
    """
    options = options_of(settings)  # the LM's keys (`experiments.lm.config`)
    objective = options["objective"]
    network = make_model(settings.model, **{key: options[key] for key in MODEL_OPTIONS})
    separator = _separator(settings, options, network.vocab_size)
    model = settings.repl.apply_policy(network)
    tx = settings.make_optimizer()
    keeps_reference = objective in PREFERENCE_OBJECTIVES and not (
        objective in preference.REFERENCE_FREE or network.lora_rank
    )

    def init_state(rng: jax.Array, example: Mapping[str, Any]) -> rp.TrainState:
        init_rng, state_rng = jax.random.split(rng)
        inputs = jnp.asarray(example["inputs"])[None]
        params = model.init(init_rng, inputs)["params"]
        if keeps_reference:  # the starting weights, frozen (`Experiment.copies` fills it)
            params = {**params, REFERENCE: jax.tree.map(jnp.copy, params)}
        return rp.TrainState.create(
            params,
            tx,
            state_rng,
            policy=settings.repl.precision,
            grad_accum_steps=settings.grad_accum_steps,
        )

    if objective in PREFERENCE_OBJECTIVES:
        train_step, eval_step = preference_steps(model, tx, options, lora=bool(network.lora_rank))
        summarized, names = preference.summarize, preference.METRIC_NAMES
    else:
        token_bytes = None if settings.shapes_only else _token_bytes(options, network.vocab_size)
        train_step, eval_step = lm_steps(model, tx, token_bytes)
        summarized = summarize_sft if objective == "sft" else summarize
        names = METRIC_NAMES
    return Experiment(
        preprocess=make_preprocess(network.max_len, separator, objective),
        init_state=init_state,
        train_step=train_step,
        eval_step=eval_step,
        summarize=summarized,
        metric_names=names,
        units=("tokens", network.max_len),
        copies=((f"params/{REFERENCE}/", "params/"),) if keeps_reference else (),
        notes=tuple(note for note in [padding_note(network)] if note),
    )


def _token_bytes(options: Mapping[str, Any], vocab_size: int) -> np.ndarray:
    """The config tokenizer's bytes per id (`Tokenizer.token_bytes`), ``[vocab_size]``."""
    table = load_tokenizer(options["tokenizer"]).token_bytes()[:vocab_size]
    return np.pad(table, (0, vocab_size - len(table)))


def lm_steps(
    model: Any, tx: Any, token_bytes: np.ndarray | None = None
) -> tuple[Callable, Callable]:
    """The train and eval steps of next-token prediction: the mean over the global batch's
    weighted tokens (`token_weights`), in nats; a mixture of experts' auxiliary losses
    added to the training loss. With ``token_bytes`` (bytes of text per id) the eval step
    also sums the target tokens' bytes: `summarize`'s ``bits_per_byte``."""

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
            if aux is not None:
                loss, sums = _with_moe_aux(loss, sums, aux, sums["tokens"] / total_tokens, model)
            return loss, sums

        (_, sums), grads = state.value_and_grad(loss_fn, batch, has_aux=True)
        return state.apply_gradients(grads, tx), sums

    def eval_step(eval_state: Mapping[str, Any], batch: Mapping[str, jax.Array]):
        weights = token_weights(batch)
        nats = token_nats(model, eval_state["params"], batch)
        # where, not a product: padding never contributes, even as 0 * inf.
        sums = {"loss": jnp.sum(jnp.where(weights > 0, nats, 0.0)), "tokens": jnp.sum(weights)}
        if token_bytes is not None:
            counted = jnp.take(jnp.asarray(token_bytes, jnp.float32), batch["targets"], mode="clip")
            sums["bytes"] = jnp.sum(jnp.where(weights > 0, counted * weights, 0.0))
        return sums

    return train_step, eval_step


def padding_note(model: Any) -> str | None:
    """What a mixture of experts computes on empty expert slots (`rp.moe.padding_fraction`),
    for ``compile``'s report (`Experiment.notes`); None for a dense model.

    >>> from experiments.lm.model import Transformer
    >>> padding_note(Transformer(num_experts=8, experts_per_token=2, expert_capacity_factor=1.25))
    "mixture of experts: capacity_factor 1.25, 20% of the experts' FLOPs at least on empty slots"
    >>> padding_note(Transformer(num_experts=8, expert_capacity_factor=None))
    'mixture of experts: dropless, 0% of the FLOPs on padding'
    """
    if not model.num_experts:
        return None
    factor = model.expert_capacity_factor
    if factor is None:
        return "mixture of experts: dropless, 0% of the FLOPs on padding"
    share = rp.moe.padding_fraction(
        model.max_len, model.num_experts, model.experts_per_token, factor
    )
    return (
        f"mixture of experts: capacity_factor {factor:g}, {share:.0%} of the experts' FLOPs "
        "at least on empty slots"
    )


def _with_moe_aux(loss: jax.Array, sums: dict, aux: Any, share: jax.Array, model: Any):
    """The loss with a mixture of experts' auxiliary losses (means over the MoE layers,
    weighed by the model keys ``moe_balance_weight`` and ``moe_z_loss_weight``), each
    call's by its ``share`` of the global batch (tokens or pairs), and its dropped
    fraction summed."""
    balance, z_loss = model.moe_balance_weight, model.moe_z_loss_weight
    extra = balance * aux.load_balance_loss + z_loss * aux.router_z_loss
    dropped = aux.dropped_fraction * sums["tokens"]
    return loss + share * extra, {**sums, "dropped": dropped}


def preference_steps(
    model: Any, tx: Any, options: Mapping[str, Any], *, lora: bool
) -> tuple[Callable, Callable]:
    """The train and eval steps of a preference loss (`experiments.lm.preference`): the
    mean over the global batch's pairs; sums of the loss and TRL's rewards and logps.

    The reference log-probabilities (``dpo``, ``ipo``) come from the base model without
    its adapters under LoRA, else from the frozen ``params/reference/``; both in the
    step, without gradient."""
    objective, beta = options["objective"], options["dpo_beta"]
    smoothing, gamma = options["dpo_label_smoothing"], options["simpo_gamma"]

    def pair_values(params, batch, train: bool, rng: Any = None):
        policy_params = {k: v for k, v in params.items() if k != REFERENCE}
        weights, segments = token_weights(batch), batch["target_segments"]
        rngs = {"dropout": rng} if train else {}
        nats, aux = nats_and_moe_aux(model, policy_params, batch, train=train, rngs=rngs)
        policy = preference.pair_logps(-nats, weights, segments)
        reference = None
        if objective not in preference.REFERENCE_FREE:
            if lora:
                ref_nats = token_nats(model, policy_params, batch, adapters=False)
            else:
                ref_nats = token_nats(model, params[REFERENCE], batch)
            ref_logps = -jax.lax.stop_gradient(ref_nats)
            reference = preference.pair_logps(ref_logps, weights, segments)
        loss, values = preference.losses(
            objective, policy, reference, beta=beta, label_smoothing=smoothing, gamma=gamma
        )
        sums = {
            "loss": jnp.sum(loss),
            "pairs": jnp.sum(policy.valid.astype(jnp.float32)),
            "tokens": jnp.sum(weights),
            **{name: jnp.sum(value) for name, value in values.items()},
        }
        return loss, policy.valid, sums, aux

    def train_step(state: rp.TrainState, batch: Mapping[str, jax.Array]):
        valid = preference.pair_logps(
            jnp.zeros_like(batch["target_weights"]), token_weights(batch), batch["target_segments"]
        ).valid
        total_pairs = rp.global_sum(valid.astype(jnp.float32))
        dropout_rng = rp.replica_key(jax.random.fold_in(state.rng, state.step))

        def loss_fn(params, batch):
            loss_BxP, valid_BxP, sums, aux = pair_values(params, batch, True, dropout_rng)
            loss = rp.compute_average_loss(
                loss_BxP, global_batch_size=total_pairs, sample_weight=valid_BxP
            )
            if aux is not None:
                loss, sums = _with_moe_aux(loss, sums, aux, sums["pairs"] / total_pairs, model)
            return loss, sums

        (_, sums), grads = state.value_and_grad(loss_fn, batch, has_aux=True)
        return state.apply_gradients(grads, tx), sums

    def eval_step(eval_state: Mapping[str, Any], batch: Mapping[str, jax.Array]):
        return pair_values(eval_state["params"], batch, False)[2]

    return train_step, eval_step


def summarize_sft(sums: Mapping[str, Any]) -> dict[str, float]:
    """`summarize`, and the tokens the loss covered (the assistant tokens) as
    ``trained_tokens``.

    >>> summarize_sft({"loss": np.float32(6.0), "tokens": np.float32(4.0)})["trained_tokens"]
    4
    """
    return {**summarize(sums), "trained_tokens": int(float(sums["tokens"]))}
