"""Qwen3, Mixtral and Qwen3-MoE checkpoints in and out of the LM, against transformers.

Random tiny checkpoints (every weight drawn, norms and routers too), written by
transformers' ``save_pretrained`` and imported (``init_from='hf:DIR'``): the logits equal
transformers' forward in float32, greedy continuations equal ``generate``, and an
export of changed weights reloads in ``from_pretrained`` with the LM's logits. The
mixtures route dropless: nothing is dropped however unbalanced the routing, and the
training loss's balancing term is transformers' ``load_balancing_loss_func``.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from replicator.errors import ConfigError
from replicator.trainer import init_from, pretrained
from tests.test_hf import IDS, VOCAB, hf_logits, import_params, save

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def qwen3():
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(config)


def mixtral(layers=2):
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, router_aux_loss_coef=0.02,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def qwen3_moe(norm_topk_prob=True):
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


FAMILIES = {
    "qwen3": qwen3,
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "qwen3_moe_unnormalised": lambda: qwen3_moe(norm_topk_prob=False),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family's model and its ``hf:DIR``, made once."""
    root = tmp_path_factory.mktemp("hf_qwen3_moe")
    made = {}
    for name, make in FAMILIES.items():
        model = make()
        made[name] = (model, save(model, root / name))
    return made


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tfds"))


def logits(net, params, ids) -> np.ndarray:
    return np.asarray(jax.jit(net.apply)(params, jnp.asarray(ids, jnp.int32)))


def assert_close(got, want, tol=1e-5):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("family", FAMILIES)
def test_imported_logits_equal_hf(family, saved):
    model, spec = saved[family]
    net, params, the_plan = import_params(spec)
    assert not the_plan.fresh and not the_plan.unused, the_plan.details()
    assert_close(logits(net, params, IDS), hf_logits(model, IDS))


def test_the_keys_and_summary_say_what_the_checkpoint_is(saved):
    keys = {}
    for family in ("qwen3", "mixtral", "qwen3_moe", "qwen3_moe_unnormalised"):
        _, hf_config = pretrained.read_hf_config(saved[family][1])
        keys[family] = pretrained.layout("experiments.lm", {"max_len": 64}, hf_config)
    assert keys["qwen3"].model["qk_norm"] and keys["qwen3"].model["head_dim"] == 16
    mixture = keys["mixtral"].model
    assert (mixture["num_experts"], mixture["experts_per_token"], mixture["mlp_dim"]) == (4, 2, 48)
    assert mixture["expert_capacity_factor"] is None and mixture["expert_routing"] == "mixtral"
    assert mixture["moe_balance_weight"] == pytest.approx(0.04) and not mixture["qk_norm"]
    assert keys["qwen3_moe"].model["mlp_dim"] == 24 and keys["qwen3_moe"].model["qk_norm"]
    assert keys["qwen3_moe_unnormalised"].model["expert_routing"] == "switch"
    assert "q/k norm" in keys["qwen3"].summary
    assert "4 experts, top 2 (mixtral, dropless)" in keys["mixtral"].summary


def test_unscanned_mixtures_import_too(saved):
    model, spec = saved["qwen3_moe"]
    net, params, the_plan = import_params(spec, scan_layers=False)
    assert "block_1" in params["params"] and not the_plan.fresh
    assert_close(logits(net, params, IDS), hf_logits(model, IDS))


# Qwen3's q/k norms decode in the unnormalised Qwen3-MoE's too: its own case is test-slow.
GREEDY = [pytest.param("qwen3", marks=pytest.mark.slow), "mixtral", "qwen3_moe_unnormalised"]


@pytest.mark.parametrize("family", GREEDY)
def test_greedy_continuations_equal_generate(family, saved):
    from experiments.lm.sample import generate

    model, spec = saved[family]
    net, params, _ = import_params(spec)
    prompts = [list(IDS[0, :7]), list(IDS[1, :11])]
    ours = generate(net, params["params"], prompts, max_new_tokens=8, temperature=0)
    for prompt, sample in zip(prompts, ours):
        with torch.no_grad():
            theirs = model.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                eos_token_id=None,
            )[0, len(prompt):].tolist()  # fmt: skip
        assert list(sample.ids) == theirs


def _changed(params):
    """Every parameter moved a little: an export must write the weights it is given."""
    rng = np.random.default_rng(1)
    moved = lambda x: jnp.asarray(x + 0.05 * rng.standard_normal(x.shape, np.float32))  # noqa: E731
    return jax.tree.map(moved, params)


@pytest.mark.parametrize("family", ["qwen3", "mixtral", "qwen3_moe_unnormalised"])
def test_an_export_reloads_in_transformers_with_the_same_logits(family, saved, tmp_path):
    from replicator.trainer import export

    model, spec = saved[family]
    net, params, _ = import_params(spec)
    params = _changed(params)
    _, hf_config = pretrained.read_hf_config(spec)
    keys = pretrained.layout("experiments.lm", {"max_len": 64}, hf_config).model
    layout = pretrained.layout("experiments.lm", keys, None)
    assert layout.config["architectures"] == hf_config["architectures"]
    export._export_weights(str(tmp_path), layout, init_from.model_paths(params), 1, 2**30)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), output_loading_info=True
    )
    assert not any(info.values()), info
    assert_close(hf_logits(loaded.eval(), IDS), logits(net, params, IDS), 1e-4)
    for key in ("num_local_experts", "num_experts_per_tok", "norm_topk_prob"):
        assert getattr(loaded.config, key, None) == getattr(model.config, key, None), key


def logits_and_aux(net, params, ids):
    """The logits and the `MoEAux` averaged over the layers (one forward)."""
    from experiments.lm.task import _mean_moe_aux

    apply = jax.jit(lambda p, x: net.apply(p, x, mutable=["intermediates"]))
    out, variables = apply(params, jnp.asarray(ids, jnp.int32))
    return np.asarray(out), _mean_moe_aux(variables)


def test_nothing_is_dropped_however_unbalanced(saved):
    """One token repeated: every position reaches the first mixture with the same hidden
    state (the attention averages equal values), so all go to the same two experts."""
    model, spec = saved["mixtral"]
    ids = np.full((2, 24), 7)
    net, params, _ = import_params(spec)
    assert net.expert_capacity_factor is None  # imported dropless
    got, aux = logits_and_aux(net, params, ids)
    assert float(aux.dropped_fraction) == 0.0
    assert_close(got, hf_logits(model, ids))
    # With a capacity, layer 0's experts take 12 of their 24 pairs each: half dropped.
    got, aux = logits_and_aux(net.clone(expert_capacity_factor=1.0), params, ids)
    assert float(aux.dropped_fraction) >= 0.5 / 2
    assert np.abs(got - hf_logits(model, ids)).max() > 1e-3


def test_the_balancing_loss_is_transformers_load_balancing_loss_func():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = np.random.default_rng(0).normal(size=(3, 40, 8)).astype(np.float32) * 2
    for routing, k in (("mixtral", 2), ("switch", 3)):  # the same f_e and P_e either way
        ours = rp.moe.route(jnp.asarray(logits), experts_per_token=k, capacity=None,
                            routing=routing).aux.load_balance_loss  # fmt: skip
        theirs = load_balancing_loss_func((torch.tensor(logits.reshape(-1, 8)),), 8, k)
        np.testing.assert_allclose(k * float(ours), float(theirs), rtol=1e-5)


def test_the_training_loss_is_transformers_with_its_router_loss(saved):
    """Cross-entropy + router_aux_loss_coef x aux_loss, as ``MixtralForCausalLM``
    computes it with ``output_router_logits=True``: the two layers' routing pooled."""
    from experiments.lm.task import _with_moe_aux, nats_and_moe_aux

    model, spec = saved["mixtral"]
    net, params, _ = import_params(spec)
    inputs, targets = IDS[:, :-1], IDS[:, 1:]
    with torch.no_grad():
        out = model(torch.tensor(inputs), output_router_logits=True)
        nats = torch.nn.functional.cross_entropy(
            out.logits.reshape(-1, VOCAB), torch.tensor(targets).reshape(-1)
        )
        theirs = float(nats + model.config.router_aux_loss_coef * out.aux_loss)
    batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    losses = []
    for pooled in (True, False):
        layers = net.clone(moe_balance_pooled=pooled)
        nats, aux = nats_and_moe_aux(layers, params["params"], batch)
        losses.append(float(_with_moe_aux(jnp.mean(nats), {"tokens": 1}, aux, 1.0, layers)[0]))
    np.testing.assert_allclose(losses[0], theirs, rtol=1e-5)
    assert abs(losses[1] - theirs) > 1e-5  # each layer's loss averaged: not transformers'


def test_checkpoints_the_lm_does_not_reproduce_are_one_line():
    from experiments.lm.hf import hf_checkpoint

    base = {
        "model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_experts": 4, "num_experts_per_tok": 2,
    }  # fmt: skip
    hub = hf_checkpoint({"max_len": 64}, base).model  # the Hub's configs say num_experts
    assert (hub["num_experts"], hub["mlp_dim"], hub["expert_routing"]) == (4, 768, "switch")
    with pytest.raises(ConfigError, match="decoder_sparse_step=2") as raised:
        hf_checkpoint({"max_len": 64}, {**base, "decoder_sparse_step": 2})
    assert "\n" not in str(raised.value)
    with pytest.raises(ConfigError, match="mlp_only_layers=\\[0\\]"):
        hf_checkpoint({"max_len": 64}, {**base, "mlp_only_layers": [0]})
    with pytest.raises(ConfigError, match="moe_every=2"):
        hf_checkpoint({"num_experts": 4, "moe_every": 2, "num_layers": 2, "qk_norm": True,
                       "positions": "rotary", "norm": "rmsnorm", "mlp_activation": "swiglu",
                       "use_bias": False})  # fmt: skip


@pytest.mark.slow
def test_fine_tuning_an_imported_mixture_trains_dropless_and_exports(saved, tmp_path, data_dir):
    """A few steps from Qwen3-MoE through the trainer (the router's loss in the training
    loss, nothing dropped), then out again: transformers gives the trained logits."""
    from replicator import trainer
    from replicator.trainer.export import export_hf
    from tests.test_hf import lm_config, trained_logits

    model, spec = saved["qwen3_moe"]
    config = lm_config(spec, num_train_steps=2, eval_every_steps=2, checkpoint_every_steps=2,
                       data_dir=data_dir, learning_rate=0.01, log_every_steps=1)  # fmt: skip
    workdir = tmp_path / "run"
    trainer.train_and_evaluate(config, str(workdir), quiet=True, devices=jax.devices()[:1])
    records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    trained = [r for r in records if "dropped_fraction" in r]
    assert len(trained) == 2 and all(r["dropped_fraction"] == 0.0 for r in trained), records
    export_hf(str(workdir), str(tmp_path / "out"), devices=jax.devices()[:1])
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    ids = IDS[:, :16]
    got = hf_logits(exported.eval(), ids)
    assert_close(got, trained_logits(workdir, ids), 1e-4)
    assert np.abs(got - hf_logits(model, ids)).max() > 1e-2  # the trained weights


def random_params(model, seed=0):
    """Every parameter drawn with numpy (no compiled initialiser): the norms' scales
    around 1, the rest wide enough that the logits are far apart (no near-ties)."""
    import flax.linen as nn

    rng = np.random.default_rng(seed)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))

    def draw(path, x):
        noise = rng.standard_normal(x.shape).astype(np.float32)
        scale = jax.tree_util.keystr(path).endswith("['scale']")
        return jnp.asarray(1 + 0.1 * noise if scale else 0.3 * noise)

    return jax.tree_util.tree_map_with_path(draw, nn.meta.unbox(abstract["params"]))


@pytest.mark.parametrize("scan", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_mixture_every_other_layer_decodes_as_its_full_forward(scan):
    """The KV-cache sampler through `BlockGroup`s of two blocks (``moe_every=2``), q/k
    norms on: greedy tokens are the full forward's argmax at every position."""
    from experiments.lm.model import Transformer
    from experiments.lm.sample import generate
    from tests.test_sample import LLAMA, PROMPTS, _assert_greedy_is_full_argmax

    moe = dict(num_experts=4, experts_per_token=2, expert_capacity_factor=None, moe_every=2)
    model = Transformer(**LLAMA, **moe, qk_norm=True, scan_layers=scan, attention="xla")
    params = random_params(model)
    assert "q_norm" in str(jax.tree_util.tree_structure(params))
    samples = generate(model, params, PROMPTS[:2], max_new_tokens=4, temperature=0)
    _assert_greedy_is_full_argmax(model, params, samples)
