"""Post-training losses against the library that defines them, and packing invariants.

The preference losses (DPO, IPO, SimPO) and their gradients equal TRL's own code on the
same log-probabilities (`tests.helpers.trl_reference`); the rewards and logps the step
reports equal what TRL logs. Packed pairs and packed conversations give, per sequence,
exactly what the sequence gives alone, and the SFT loss takes nothing from the tokens
its mask leaves out.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import replicator as rp
from experiments.lm import preference
from experiments.lm.model import Transformer
from experiments.lm.task import make_experiment, segment_layout, token_nats
from replicator.trainer import Settings
from tests.helpers import trl_reference

PAIRS, LENGTH = 5, 24


def _pairs(seed: int = 0):
    """P pairs: each window holds one pair (chosen then rejected), random per-token
    log-probabilities, a prompt of 2-4 tokens before each response (weight 0)."""
    rng = np.random.default_rng(seed)
    logps = -rng.exponential(1.0, (PAIRS, LENGTH)).astype(np.float32)
    weights = np.zeros((PAIRS, LENGTH), np.float32)
    segments = np.zeros((PAIRS, LENGTH), np.int32)
    spans = []
    for p in range(PAIRS):
        n_c, n_r = rng.integers(4, 11, 2)
        prompt = rng.integers(2, 5)
        segments[p, :n_c], segments[p, n_c : n_c + n_r] = 1, 2
        weights[p, prompt:n_c], weights[p, n_c + prompt : n_c + n_r] = 1, 1
        spans.append((n_c, n_r, prompt))
    ref = -rng.exponential(1.0, (2, PAIRS)).astype(np.float32) * 8
    return logps, weights, segments, spans, ref


def _ours(objective, logps, weights, segments, ref, **kw):
    """Our mean loss over the pairs and the values per pair, as the step averages them."""

    def mean_loss(token_logps):
        policy = preference.pair_logps(token_logps, weights, segments)
        reference = None
        if objective != "simpo":  # the reference's sums given (its tokens as the policy's)
            reference = policy._replace(chosen=ref[0][:, None], rejected=ref[1][:, None])
        policy = policy._replace(**{k: getattr(policy, k)[:, :1] for k in policy._fields})
        loss, values = preference.losses(objective, policy, reference, **kw)
        count = jnp.sum(policy.valid)
        return jnp.sum(loss) / count, {k: jnp.sum(v) / count for k, v in values.items()}

    (loss, values), grads = jax.value_and_grad(mean_loss, has_aux=True)(jnp.asarray(logps))
    return float(loss), {k: float(v) for k, v in values.items()}, np.asarray(grads)


def _trl_rows(logps, spans):
    """TRL's layout of the same pairs: rows [chosen..., rejected...], each sequence from
    position 0; ``token_logps[:, t]`` predicts token t + 1 (completion_mask's shift)."""
    rows = np.zeros((2 * PAIRS, LENGTH), np.float32)
    mask = np.zeros((2 * PAIRS, LENGTH + 1), np.int64)
    for p, (n_c, n_r, prompt) in enumerate(spans):
        rows[p, :n_c], rows[PAIRS + p, :n_r] = logps[p, :n_c], logps[p, n_c : n_c + n_r]
        mask[p, prompt + 1 : n_c + 1], mask[PAIRS + p, prompt + 1 : n_r + 1] = 1, 1
    return torch.tensor(rows, requires_grad=True), mask


def _ours_layout(grads_TRL, spans):
    out = np.zeros((PAIRS, LENGTH), np.float32)
    for p, (n_c, n_r, _) in enumerate(spans):
        out[p, :n_c], out[p, n_c : n_c + n_r] = grads_TRL[p, :n_c], grads_TRL[PAIRS + p, :n_r]
    return out


@pytest.mark.parametrize("objective", ["dpo", "ipo"])
def test_dpo_and_ipo_equal_trls_dpo_trainer_loss_gradient_and_logged_rewards(objective):
    logps, weights, segments, spans, ref = _pairs()
    loss, values, grads = _ours(objective, logps, weights, segments, ref, beta=0.3)
    rows, mask = _trl_rows(logps, spans)
    trl_loss, logged = trl_reference.dpo(
        "sigmoid" if objective == "dpo" else "ipo", rows, mask, ref[0], ref[1], beta=0.3
    )
    trl_loss.backward()
    assert loss == pytest.approx(trl_loss.item(), rel=1e-5)
    np.testing.assert_allclose(grads, _ours_layout(rows.grad.numpy(), spans), atol=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                 "logps/chosen", "logps/rejected"):  # fmt: skip
        assert values[name] == pytest.approx(logged[name], rel=1e-5, abs=1e-6), name
    # The rewards follow from the logged logps and the reference's.
    recomputed = 0.3 * (values["logps/chosen"] - values["logps/ref_chosen"])
    assert values["rewards/chosen"] == pytest.approx(recomputed, rel=1e-5)


@pytest.mark.parametrize("objective, trl_type", [("dpo", "sigmoid"), ("simpo", "simpo")])
def test_label_smoothing_and_simpo_equal_trls_cpo_loss(objective, trl_type):
    logps, weights, segments, spans, ref = _pairs(1)
    kw = dict(beta=2.0 if objective == "simpo" else 0.3, label_smoothing=0.1)
    loss, values, grads = _ours(objective, logps, weights, segments, ref, gamma=0.7, **kw)
    rows, mask = _trl_rows(logps, spans)
    sums = (rows * torch.tensor(mask[:, 1:])).sum(1)
    tokens = torch.tensor(mask[:, 1:].sum(1), dtype=torch.float32)
    if objective == "simpo":  # CPO averages the logps per token for SimPO
        chosen, rejected = (sums / tokens)[:PAIRS], (sums / tokens)[PAIRS:]
    else:  # CPO's sigmoid on DPO's log-ratios is conservative DPO
        chosen, rejected = sums[:PAIRS] - torch.tensor(ref[0]), sums[PAIRS:] - torch.tensor(ref[1])
    trl_losses, chosen_rewards, rejected_rewards = trl_reference.cpo(
        trl_type, chosen, rejected, simpo_gamma=0.7, **kw
    )
    trl_losses.mean().backward()
    assert loss == pytest.approx(trl_losses.mean().item(), rel=1e-5)
    np.testing.assert_allclose(grads, _ours_layout(rows.grad.numpy(), spans), atol=1e-6)
    assert values["rewards/chosen"] == pytest.approx(float(chosen_rewards.mean()), rel=1e-5)
    assert values["rewards/rejected"] == pytest.approx(float(rejected_rewards.mean()), rel=1e-5)


def test_sigmoid_dpo_starts_at_log_two_and_a_pair_without_tokens_counts_for_nothing():
    logps, weights, segments, _, _ = _pairs()
    weights[-1] = 0.0  # the last window holds no pair
    policy = preference.pair_logps(jnp.asarray(logps), weights, segments)
    loss, values = preference.losses("dpo", policy, policy, beta=0.1)
    valid = np.asarray(policy.valid)
    assert valid.sum() == PAIRS - 1
    np.testing.assert_allclose(np.asarray(loss)[valid], math.log(2), rtol=1e-6)
    assert float(jnp.sum(loss[~valid])) == 0.0 and float(jnp.sum(values["rewards/margins"])) == 0


# ---- through the model: packed sequences equal sequences alone

MODEL = Transformer(
    vocab_size=64, num_layers=2, num_heads=4, embed_dim=32, max_len=48, positions="rotary",
    norm="rmsnorm", mlp_activation="swiglu", num_kv_heads=2, use_bias=False,
    tie_embeddings=False, attention="xla",
)  # fmt: skip


@pytest.fixture(scope="module")
def params():
    return MODEL.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]


def _window(sequences, masks, length):
    """``sequences`` packed one after another into a window of ``length + 1`` tokens."""
    tokens, segments, loss_mask = (np.zeros(length + 1, np.int32) for _ in range(3))
    at = 0
    for i, (seq, mask) in enumerate(zip(sequences, masks)):
        tokens[at : at + len(seq)], segments[at : at + len(seq)] = seq, i + 1
        loss_mask[at : at + len(seq)] = mask
        at += len(seq)
    return tokens, segments, loss_mask


def _batch(windows, objective):
    tokens, segments, loss_mask = (np.stack(x) for x in zip(*windows))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    batch.update(segment_layout(segments, loss_mask, objective))
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _sequences(seed, count):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n, prompt = int(rng.integers(6, 12)), int(rng.integers(2, 5))
        out.append((rng.integers(1, 64, n), (np.arange(n) >= prompt).astype(np.int32)))
    return out


def test_packed_pairs_give_each_pair_what_it_gives_alone(params):
    seqs = _sequences(0, 4)  # two pairs: (chosen, rejected), (chosen, rejected)
    packed = _batch([_window([s for s, _ in seqs], [m for _, m in seqs], 47)], "dpo")
    alone = _batch(
        [_window([s for s, _ in seqs[i : i + 2]], [m for _, m in seqs[i : i + 2]], 47)
         for i in (0, 2)], "dpo",
    )  # fmt: skip

    def logps(batch):
        nats = token_nats(MODEL, params, batch)
        return preference.pair_logps(-nats, batch["target_weights"], batch["target_segments"])

    got, want = logps(packed), logps(alone)
    np.testing.assert_allclose(
        np.asarray(got.chosen[0, :2]), np.asarray(want.chosen[:, 0]), rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(got.rejected[0, :2]), np.asarray(want.rejected[:, 0]), rtol=1e-5
    )
    assert np.asarray(got.valid[0]).tolist()[:3] == [True, True, False]


def test_packed_conversations_give_each_conversation_its_loss_alone(params):
    seqs = _sequences(1, 3)
    packed = _batch([_window([s for s, _ in seqs], [m for _, m in seqs], 47)], "sft")
    nats = np.asarray(token_nats(MODEL, params, packed))
    weights, segments = np.asarray(packed["target_weights"]), np.asarray(packed["segment_ids"])
    for i, (seq, mask) in enumerate(seqs):
        alone = _batch([_window([seq], [mask], len(seq) - 1)], "sft")
        want = (
            np.asarray(token_nats(MODEL, params, alone))[0] @ np.asarray(alone["target_weights"])[0]
        )
        got = (nats[0] * weights[0])[segments[0] == i + 1].sum()
        assert got == pytest.approx(float(want), rel=1e-5)
        assert np.asarray(alone["target_weights"]).sum() == mask[1:].sum()  # the response only


def _settings(repl, objective, **model):
    keys = dict(vocab_size=64, num_layers=1, num_heads=2, embed_dim=16, max_len=48,
                positions="rotary", norm="rmsnorm", mlp_activation="swiglu", use_bias=False,
                attention="xla")  # fmt: skip
    return Settings(
        repl=repl, model={**keys, **model}, learning_rate=0.1, optimizer="sgd",
        num_train_steps=2, grad_accum_steps=1, seed=0, options={"objective": objective},
    )  # fmt: skip


def test_sft_takes_no_gradient_from_a_token_its_mask_leaves_out():
    """The targets the loss mask leaves out (prompt tokens, padding) can be anything: the
    step's loss and update do not change."""
    repl = rp.Replicator(devices=jax.devices()[:1])
    experiment = make_experiment(_settings(repl, "sft"))
    seqs = _sequences(2, 2)
    batch = _batch([_window([s], [m], 47) for s, m in seqs], "sft")
    noisy = dict(batch)
    off = np.asarray(batch["target_weights"]) == 0
    random = np.random.default_rng(3).integers(0, 64, off.shape)
    noisy["targets"] = jnp.where(off, random, batch["targets"])
    assert (np.asarray(noisy["targets"]) != np.asarray(batch["targets"])).any()
    state = experiment.init_state(jax.random.key(0), jax.tree.map(lambda x: x[0], batch))
    step = jax.jit(experiment.train_step)
    (a, sums_a), (b, sums_b) = step(state, batch), step(state, noisy)
    assert float(sums_a["loss"]) == float(sums_b["loss"])
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert float(sums_a["tokens"]) == sum(m[1:].sum() for _, m in seqs)


def test_dpo_without_lora_keeps_a_reference_copy_and_starts_at_log_two():
    repl = rp.Replicator(devices=jax.devices()[:1])
    experiment = make_experiment(_settings(repl, "dpo"))
    assert experiment.copies == (("params/reference/", "params/"),)
    batch = _batch([_window([s for s, _ in _sequences(4, 2)], [m for _, m in _sequences(4, 2)],
                            47)], "dpo")  # fmt: skip
    state = experiment.init_state(jax.random.key(0), jax.tree.map(lambda x: x[0], batch))
    assert set(state.params) >= {"reference", "token_embedding"}
    _, sums = jax.jit(experiment.train_step)(state, batch)
    summary = experiment.summarize(jax.device_get(sums))
    assert summary["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert summary["pairs"] == 1 and summary["rewards/margins"] == 0.0
