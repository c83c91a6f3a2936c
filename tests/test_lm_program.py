"""The LM's program: scanned layers, named rematerialisation, fused attention.

Each lever changes the program, never the numbers: a scanned stack computes what
the unrolled blocks compute from the same parameters; every remat policy gives
the gradients of none; splash attention (run by Pallas's interpreter here) gives
XLA's attention, also inside `Replicator.compile` and `run` over 8 devices. On a
TPU topology (libtpu, compiled from this CPU host) the program holds one loop
over the layers and the splash kernel, and full remat needs less memory.
"""

import contextlib
import io
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from experiments.lm import Transformer, make_experiment
from replicator.attention import kernels as attention
from replicator.step import remat as remat
from replicator.trainer import ConfigError
from replicator.trainer.experiment import Settings
from tests.compare import assert_trained_alike

TINY = dict(vocab_size=32, num_layers=3, num_heads=2, embed_dim=16, mlp_dim=32, max_len=128)


def _tokens(batch: int = 2, length: int = 128) -> jax.Array:
    return jax.random.randint(jax.random.key(1), (batch, length), 0, 32)


def _stacked(unrolled: dict, num_layers: int) -> dict:
    """Unrolled parameters (``block_<i>``) as the scanned model's (``blocks``)."""
    params = {k: v for k, v in unrolled.items() if not k.startswith("block_")}
    layers = [unrolled[f"block_{i}"] for i in range(num_layers)]
    params["blocks"] = jax.tree.map(lambda *x: jnp.stack(x), *layers)
    return params


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_scanned_layers_compute_what_the_unrolled_blocks_do():
    tokens = _tokens()
    unrolled = Transformer(**TINY, scan_layers=False)
    params = nn.meta.unbox(unrolled.init(jax.random.key(0), tokens)["params"])
    scanned = Transformer(**TINY)
    stacked = _stacked(params, TINY["num_layers"])
    shapes = jax.tree.map(jnp.shape, nn.meta.unbox(scanned.init(jax.random.key(0), tokens)))
    assert jax.tree.map(jnp.shape, {"params": stacked}) == shapes

    def loss_and_grads(model, p):
        loss = lambda p: model.apply({"params": p}, tokens, targets=tokens).mean()
        return jax.jit(jax.value_and_grad(loss))(p)

    loss, grads = loss_and_grads(unrolled, params)
    scanned_loss, scanned_grads = loss_and_grads(scanned, stacked)
    np.testing.assert_allclose(scanned_loss, loss, rtol=1e-6)
    _assert_trees_close(scanned_grads, _stacked(grads, TINY["num_layers"]), 1e-6)


@pytest.mark.parametrize(
    "policy",
    [
        "full",
        pytest.param("minimal", marks=pytest.mark.slow),
        *(pytest.param(p, marks=pytest.mark.slow) for p in remat.REMAT_POLICIES[3:]),
    ],
)
def test_every_remat_policy_gives_the_gradients_of_none(policy):
    tokens = _tokens()
    params = Transformer(**TINY).init(jax.random.key(0), tokens)["params"]

    def grads(policy):
        model = Transformer(**TINY, remat_policy=policy)
        if policy == "minimal_offloaded":  # needs a backend with pinned host memory
            model = Transformer(**TINY, remat_policy="minimal")
        loss = lambda p: model.apply({"params": p}, tokens, targets=tokens).mean()
        return jax.jit(jax.grad(loss))(params)

    _assert_trees_close(grads(policy), grads(None), 1e-7)


def test_remat_policies_keep_what_their_names_say():
    """``minimal`` keeps the projections, ``full`` none of them: fewer residuals."""
    tokens = _tokens()
    model = Transformer(**TINY)
    params = model.init(jax.random.key(0), tokens)["params"]

    def saved(policy):
        model = Transformer(**TINY, remat_policy=policy, scan_layers=False)
        loss = lambda p: model.apply({"params": p}, tokens, targets=tokens).mean()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(loss, _unrolled(params))
        shapes = re.findall(r"^\w+\[([\d,]*)\]", out.getvalue(), re.MULTILINE)
        return sum(math.prod(int(d) for d in s.split(",") if d) for s in shapes)

    sizes = {policy: saved(policy) for policy in (None, "minimal", "save_qkv_proj", "full")}
    assert sizes[None] > sizes["minimal"] > sizes["save_qkv_proj"] > sizes["full"], sizes


def _assert_trees_close(a, b, atol: float) -> None:
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=atol), a, b)


def _unrolled(stacked: dict) -> dict:
    params = {k: v for k, v in stacked.items() if k != "blocks"}
    for i in range(TINY["num_layers"]):
        params[f"block_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked["blocks"])
    return params


def test_splash_attention_equals_xla_attention_and_its_gradients():
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 256, 2, 16))
    outs = {}
    for impl in ("splash", "xla"):
        f = lambda q, k, v, impl=impl: attention.causal_attention(q, k, v, implementation=impl)
        outs[impl] = jax.value_and_grad(lambda *a, f=f: (f(*a) ** 2).sum(), (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(outs["splash"][0], outs["xla"][0], rtol=1e-5)
    for a, b in zip(outs["splash"][1], outs["xla"][1]):
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("policy, forwards", [("minimal", 2), ("minimal_with_context", 1)])
def test_a_policy_keeping_the_context_runs_splash_forward_once(policy, forwards):
    """Splash's backward needs its forward's output and log-sum-exp: a policy that keeps
    the attention's output (``context``) keeps both, and the gradient runs one forward
    kernel; ``minimal`` recomputes it. Read from the gradient's jaxpr (the kernels as
    Pallas calls, whatever backend)."""
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 256, 2, 16))

    def block(q, k, v):
        q = jax.ad_checkpoint.checkpoint_name(q * 2.0, "query_proj")
        return attention.causal_attention(q, k, v, implementation="splash")

    rematted = jax.checkpoint(block, policy=remat.checkpoint_policy(policy))
    loss = lambda q, k, v: (rematted(q, k, v) ** 2).sum()
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v))
    names = re.findall(r"name=(splash_mha_\w+)", jaxpr)
    assert sum("fwd" in n for n in names) == forwards, names
    assert sum("dq" in n for n in names) == 1, names


@pytest.mark.slow  # 27 s: Pallas's interpreter inside shard_map; the kernel alone runs always
def test_splash_attention_in_an_lm_on_8_devices_trains_like_xla():
    """Inside `Replicator.compile` the kernel runs under shard_map over the batch (the
    activation rules' axes) and heads; under `run` it is refused, in one line."""
    repl = rp.Replicator(mesh={"data": 2, "fsdp": 2, "tensor": 2})
    batch = {"inputs": _tokens(8), "targets": _tokens(8)}
    losses = {}
    for impl in ("splash", "xla"):
        settings = Settings(
            repl=repl, model={**TINY, "num_layers": 1, "attention": impl}, learning_rate=1e-3,
            optimizer="adam", num_train_steps=2, grad_accum_steps=1, seed=0,
        )  # fmt: skip
        experiment = make_experiment(settings)
        state = repl.replicate(experiment.init_state(jax.random.key(0), jax.tree.map(
            lambda x: x[0], batch)))  # fmt: skip
        step = repl.compile(experiment.train_step)
        sharded = repl.shard_batch(batch)
        if impl == "splash":
            with pytest.raises(ValueError, match="runs in the global view"):
                repl.run(experiment.train_step, state, sharded)
        state, sums = step(state, sharded)
        state, sums = step(state, sharded)
        losses[impl] = (float(sums["loss"]), state.params)
    np.testing.assert_allclose(losses["splash"][0], losses["xla"][0], rtol=1e-5)
    assert_trained_alike(*(jax.device_get(losses[impl][1]) for impl in ("splash", "xla")))


def test_bad_attention_and_remat_names_are_one_line():
    with pytest.raises(ValueError, match="remat_policy='minimum' is not a policy"):
        Transformer(**TINY, remat_policy="minimum")
    with pytest.raises(ValueError, match="multiple of 128"):
        attention.causal_attention(*jnp.ones((3, 1, 100, 2, 8)), implementation="splash")
    repl = rp.Replicator(devices=jax.devices()[:1])
    lm = dict(
        repl=repl, learning_rate=1e-3, optimizer="adam", num_train_steps=1,
        grad_accum_steps=1, seed=0,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="config.remat_policy now"):
        make_experiment(Settings(model={**TINY, "remat": True}, **lm))
