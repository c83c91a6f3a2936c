"""The LM's projections gathering their kernels whole (`experiments.lm.layers.gather_spec`).

The invariants: a projection whose activation is large per device gathers its kernel
over the FSDP axes and keeps it split where its activations are (heads and the MLP
width over ``tensor``); gathered or not, the LM (GPT-2's fused q/k/v and GELU MLP,
Llama's grouped q and k/v and SwiGLU) trains to the same numbers under `compile`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import replicator as rp
from experiments.lm import layers, make_experiment, make_preprocess, summarize
from replicator.parallel.activations import activation_rules
from replicator.trainer.experiment import Settings
from tests.compare import assert_trained_alike

GPT2 = dict(vocab_size=64, num_layers=2, num_heads=2, embed_dim=32, mlp_dim=64, max_len=32)
LLAMA = dict(
    GPT2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48, norm="rmsnorm",
    mlp_activation="swiglu", positions="rotary", use_bias=False,
)  # fmt: skip
MESH = {"data": 2, "fsdp": 2, "tensor": 2}


def _spec(kernel_shape, names, activation_bytes):
    """`gather_spec` while tracing on the 2x2x2 cube under the default rules, for an
    activation of ``activation_bytes`` bytes per device (the batch splits over 4)."""
    mesh = jax.make_mesh((2, 2, 2), tuple(MESH), axis_types=(AxisType.Auto,) * 3)
    activation = jax.ShapeDtypeStruct((4, activation_bytes), jnp.int8)  # a row per device
    with jax.set_mesh(mesh), activation_rules(None):
        return layers.gather_spec(jnp.zeros(kernel_shape), names, activation)


def test_a_large_activation_gathers_the_kernel_over_fsdp_only():
    big = layers.GATHER_ABOVE + 1
    assert _spec((8, 3, 4, 2), (layers.EMBED, None, layers.HEADS, layers.KV), big) == P(
        None, None, "tensor", None
    )
    assert _spec((8, 6), (layers.EMBED, layers.MLP), big) == P(None, "tensor")
    assert _spec((3, 6), (layers.EMBED, layers.MLP), big) == P(None, "tensor")
    assert _spec((3, 8), (layers.MLP, layers.EMBED), big) == P(None, None)  # 3 over 2: whole
    # At or below the threshold the product keeps XLA's collective matmul.
    assert _spec((8, 6), (layers.EMBED, layers.MLP), layers.GATHER_ABOVE) is None


def _train(path_gathered: bool, model, batches, monkeypatch):
    if path_gathered:
        monkeypatch.setattr(layers, "GATHER_ABOVE", 0)  # every product gathers
    repl = rp.Replicator(mesh=MESH)
    settings = Settings(
        repl=repl, model=model, learning_rate=3e-3, optimizer="adam", num_train_steps=2,
        grad_accum_steps=1, seed=0,
    )  # fmt: skip
    experiment = make_experiment(settings)
    state = repl.init(
        experiment.init_state, jax.random.key(0), jax.tree.map(lambda x: x[0], batches[0])
    )
    step = repl.compile(experiment.train_step)
    text = step.lower(state, repl.shard_batch(batches[0])).as_text()
    losses = []
    for batch in batches:
        state, sums = step(state, repl.shard_batch(batch))
        losses.append(summarize(jax.device_get(sums))["loss"])
    monkeypatch.undo()
    return text.count("sharding_constraint"), losses, jax.device_get(state.params)


@pytest.mark.slow  # 4 compiles on the 8-device cube (74 s on 2 cores); the spec test is fast
@pytest.mark.parametrize("model", [GPT2, LLAMA])
def test_gathered_kernels_train_like_the_collective_matmul(model, monkeypatch):
    rng = np.random.default_rng(0)
    preprocess = make_preprocess(model["max_len"])
    batches = [preprocess({"tokens": rng.integers(0, 64, (8, 33))}) for _ in range(2)]
    plain = _train(False, model, batches, monkeypatch)
    gathered = _train(True, model, batches, monkeypatch)
    # Each of a scanned block's 4 (GPT-2) or 5 (Llama) kernels is constrained once more.
    assert gathered[0] >= plain[0] + 4, (gathered[0], plain[0])
    np.testing.assert_allclose(gathered[1], plain[1], rtol=1e-5)
    assert_trained_alike(gathered[2], plain[2])
