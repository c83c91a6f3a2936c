"""Sharding beyond data parallelism: rules -> specs, sharded init, equal steps, reports."""

import dataclasses
import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.parallel import sharding as sh
from replicator.parallel.mesh import DATA_AXES, build_mesh, hybrid_mesh_devices
from replicator.step.state import TrainState
from tests.compare import assert_trained_alike

RULES = [("embed", "fsdp"), ("mlp", "tensor")]


def logical(init, names):
    return nn.with_logical_partitioning(init, names)


class MLP(nn.Module):
    """16 -> 64 -> 16, annotated with logical axes ``embed`` and ``mlp``."""

    hidden: int = 64

    @nn.compact
    def __call__(self, x):
        normal, zeros = nn.initializers.lecun_normal(), nn.initializers.zeros_init()
        h = nn.Dense(
            self.hidden,
            kernel_init=logical(normal, ("embed", "mlp")),
            bias_init=logical(zeros, ("mlp",)),
            name="fc",
        )(x)
        return nn.Dense(
            x.shape[-1],
            kernel_init=logical(normal, ("mlp", "embed")),
            bias_init=logical(zeros, ("embed",)),
            name="proj",
        )(nn.gelu(h))


def mesh_of(**sizes):
    return build_mesh(jax.devices()[: int(np.prod(list(sizes.values())))], sizes)


def specs(shardings):
    return jax.tree.map(lambda s: s.spec, nn.meta.unbox(shardings))


@pytest.fixture(autouse=True)
def sharding_warnings_are_errors():
    # A warning the test did not ask for means a wrong placement.
    with warnings.catch_warnings():
        warnings.simplefilter("error", sh.ShardingWarning)
        yield


@pytest.fixture(scope="module")
def mlp_abstract():
    return jax.eval_shape(MLP().init, jax.random.key(0), jnp.zeros((1, 16)))["params"]


# ------------------------------------------------------------------ rules -> specs


def test_annotated_mlp_gets_the_rules_specs(mlp_abstract):
    cube = sh.param_shardings(mlp_abstract, mesh_of(data=2, fsdp=2, tensor=2), RULES, min_size=0)
    assert specs(cube) == {
        "fc": {"kernel": P("fsdp", "tensor"), "bias": P("tensor")},
        "proj": {"kernel": P("tensor", "fsdp"), "bias": P("fsdp")},
    }
    # The boxes stay, holding the sharding: the tree matches the params exactly.
    assert jax.tree.structure(cube) == jax.tree.structure(mlp_abstract)
    # fsdp=8: tensor (size 1) is dropped, and fsdp also splits what `mlp` left whole.
    assert specs(sh.param_shardings(mlp_abstract, mesh_of(fsdp=8), RULES, min_size=0)) == {
        "fc": {"kernel": P("fsdp"), "bias": P("fsdp")},
        "proj": {"kernel": P(None, "fsdp"), "bias": P("fsdp")},
    }
    for mesh in (mesh_of(data=8), mesh_of(data=1)):
        flat = jax.tree.leaves(specs(sh.param_shardings(mlp_abstract, mesh, RULES, min_size=0)))
        assert flat == [P()] * 4
    # min_size is automatic FSDP's threshold: rules given explicitly apply to the small
    # parameters too (big_vision's min_size_to_shard_mb), automatic FSDP does not.
    small = sh.param_shardings(mlp_abstract, mesh_of(data=2, fsdp=2, tensor=2), RULES)
    assert specs(small) == specs(cube)
    only_fsdp = sh.param_shardings(mlp_abstract, mesh_of(fsdp=8), [("mlp", "tensor")])
    assert set(jax.tree.leaves(specs(only_fsdp))) == {P()}
    # With the default rules, small parameters stay whole.
    default = sh.param_shardings(mlp_abstract, mesh_of(data=2, fsdp=2, tensor=2))
    assert set(jax.tree.leaves(specs(default))) == {P()}


def test_a_rule_may_name_several_mesh_axes_and_is_never_a_regex(mlp_abstract):
    cube = mesh_of(data=2, fsdp=2, tensor=2)
    rules = [("embed", ("fsdp", "data")), ("mlp", "tensor")]
    placed = specs(sh.param_shardings(mlp_abstract, cube, rules, min_size=0))
    assert placed == {
        "fc": {"kernel": P(("fsdp", "data"), "tensor"), "bias": P("tensor")},
        "proj": {"kernel": P("tensor", ("fsdp", "data")), "bias": P(("fsdp", "data"))},
    }
    # A path rule (a regex key, one entry per dimension) is still one.
    path = specs(sh.param_shardings(mlp_abstract, cube, [(r"fc/kernel", ("fsdp", None))]))
    assert path["fc"]["kernel"] == P("fsdp")
    # Activation rules match no parameter, as expected of them: no warning.
    sh.param_shardings(mlp_abstract, cube, [*rules, ("activation_batch", ("data", "fsdp"))])


def test_min_size_zero_shards_every_parameter_of_the_lm():
    from experiments.lm.model import Transformer

    model = Transformer(vocab_size=256, num_layers=1, num_heads=4, embed_dim=128, max_len=128)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    mesh = mesh_of(fsdp=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sh.ShardingWarning)
        default = sh.plan_param_shardings(abstract, mesh).placements
        every = rp.Replicator(mesh={"fsdp": 8}, min_size=0).param_shardings(abstract)
    assert any("fsdp" not in p.spec for p in default)  # the biases and norm scales
    assert all("fsdp" in s.spec for s in jax.tree.leaves(nn.meta.unbox(every)))


def test_lm_params_get_fsdp_by_default():
    from experiments.lm.model import Transformer

    model = Transformer(vocab_size=256, num_layers=1, num_heads=4, embed_dim=128, max_len=128)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    plan = sh.plan_param_shardings(abstract, mesh_of(fsdp=8))
    by_path = {p.path: p for p in plan.placements}
    # The blocks are scanned: one stack, its leading "layers" axis never split.
    assert by_path["params/blocks/attention/qkv_kernel"].spec == P(None, "fsdp")
    assert by_path["params/blocks/attention/out_kernel"].spec == P(None, None, None, "fsdp")
    assert by_path["params/blocks/mlp/fc/kernel"].spec == P(None, "fsdp")
    assert by_path["params/blocks/mlp/proj/kernel"].spec == P(None, None, "fsdp")
    assert by_path["params/token_embedding/embedding"].spec == P(None, "fsdp")
    for p in plan.placements:
        big = np.prod(p.shape) >= sh.MIN_SHARD_SIZE
        assert ("fsdp" in p.spec) == big, p
    # FSDP + Megatron on the cube: heads and the MLP's hidden width on `tensor`.
    cube = {
        p.path: p.spec
        for p in sh.plan_param_shardings(abstract, mesh_of(data=2, fsdp=2, tensor=2)).placements
    }
    assert cube["params/blocks/attention/qkv_kernel"] == P(None, "fsdp", None, "tensor")
    assert cube["params/blocks/mlp/proj/kernel"] == P(None, "tensor", "fsdp")


def test_a_stacked_layers_small_parameters_stay_replicated_by_their_size_per_layer():
    # lm_1b's shape: 20 scanned blocks stack each LayerNorm scale on a "layers" axis,
    # (20, 2048) = 40,960 elements, above min_size; one layer's 2,048 is below it, so
    # the stack stays whole: no all-gather per layer in the step (issue 46).
    from experiments.lm.model import Transformer

    model = Transformer(vocab_size=256, num_layers=20, num_heads=16, embed_dim=2048,
                        mlp_dim=8192, max_len=2048)  # fmt: skip
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    plan = sh.plan_param_shardings(abstract, mesh_of(fsdp=8))
    stacked = {p.path: p for p in plan.placements if p.path.startswith("params/blocks/")}
    assert stacked["params/blocks/ln_mlp/scale"].shape == (20, 2048)
    small = {path for path, p in stacked.items() if p.spec == P()}
    assert small == {
        f"params/blocks/{name}" for name in (
            "ln_attention/scale", "ln_attention/bias", "ln_mlp/scale", "ln_mlp/bias",
            "attention/qkv_bias", "attention/out_bias", "mlp/fc/bias", "mlp/proj/bias",
        )
    }  # fmt: skip
    for path, p in stacked.items():
        per_layer = int(np.prod(p.shape[1:]))
        assert (path in small) == (per_layer < sh.MIN_SHARD_SIZE), p
    assert "fsdp" in stacked["params/blocks/mlp/fc/kernel"].spec
    # A pipeline's stages still hold their own layers of a small stack.
    staged = sh.plan_param_shardings(abstract, mesh_of(stage=2, fsdp=4)).placements
    assert {p.path: p.spec for p in staged}["params/blocks/ln_mlp/scale"] == P("stage")


def test_context_devices_hold_the_weights_as_fsdp_ones_do():
    # MaxText's placement: a context device splits the sequence and the weights.
    from experiments.lm.model import Transformer

    model = Transformer(vocab_size=256, num_layers=1, num_heads=4, embed_dim=128, max_len=128)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))

    def plan(mesh):
        return {p.path: p.spec for p in sh.plan_param_shardings(abstract, mesh).placements}

    split = plan(mesh_of(fsdp=2, context=4))
    assert split["params/blocks/attention/qkv_kernel"] == P(None, ("fsdp", "context"))
    assert split["params/blocks/mlp/fc/kernel"] == P(None, ("fsdp", "context"))
    assert plan(mesh_of(context=8))["params/blocks/mlp/fc/kernel"] == P(None, "context")
    # Unannotated: automatic FSDP splits over both, where the product divides.
    table = {"table": jnp.zeros((4096, 8)), "odd": jnp.zeros((6, 4096))}
    got = specs(sh.param_shardings(table, mesh_of(fsdp=2, context=4)))
    assert got == {"table": P(("fsdp", "context")), "odd": P(None, ("fsdp", "context"))}


def test_path_rules_and_automatic_fsdp_shard_unannotated_params():
    params = {
        "dense": {"kernel": jnp.zeros((64, 512)), "bias": jnp.zeros(512)},
        "conv": {"kernel": jnp.zeros((3, 3, 64, 128))},
        "table": jnp.zeros((4096, 8)),
    }
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    rules = [(r".*/kernel", ("fsdp", "tensor")), (r"conv/kernel", (None, None, "fsdp", "tensor"))]
    rules = [rules[1], rules[0]]  # the first match wins
    got = specs(sh.param_shardings(params, mesh, rules))
    assert got == {
        "dense": {"kernel": P("fsdp", "tensor"), "bias": P()},
        "conv": {"kernel": P(None, None, "fsdp", "tensor")},
        "table": P("fsdp"),  # no rule: the largest dimension divisible by fsdp
    }
    # nn.Partitioned boxes name mesh axes directly.
    boxed = {"w": nn.Partitioned(jnp.zeros((256, 256)), ("tensor", "fsdp"))}
    assert specs(sh.param_shardings(boxed, mesh)) == {"w": P("tensor", "fsdp")}


# ------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "rules, words",
    [
        ([*RULES, ("heads", "tensor")], ["matches nothing", "'heads'", "['embed', 'mlp']"]),
        (
            [*RULES, (r"encoder/.*", ("fsdp",))],
            ["matches nothing", "encoder/.*", "paths look like 'fc/bias'"],
        ),
        ([("embed", "model"), ("mlp", "tensor")], ["'model'", "does not have"]),
        ([*RULES, ("embed", "tensor")], ["'embed' is claimed by two rules"]),
    ],
    ids=["logical-unused", "path-unused", "unknown-axis", "claimed-twice"],
)
def test_bad_rules_warn_or_raise_naming_them(mlp_abstract, rules, words):
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    with pytest.raises(sh.ShardingError) as error:
        sh.param_shardings(mlp_abstract, mesh, rules, strict=True, min_size=0)
    for word in words:
        assert word in str(error.value)
    if any("does not have" in w or "claimed" in w for w in words):  # errors even unstrict
        with pytest.raises(sh.ShardingError, match=words[0]):
            sh.param_shardings(mlp_abstract, mesh, rules, min_size=0)
        return
    with pytest.warns(sh.ShardingWarning) as record:
        shardings = sh.param_shardings(mlp_abstract, mesh, rules, min_size=0)
    assert any(all(w in str(r.message) for w in words) for r in record)
    assert specs(shardings)["fc"]["kernel"] in (P("fsdp", "tensor"), P(None, "tensor"))


def test_large_replicated_parameter_is_named_with_its_size():
    params = {"odd": jax.ShapeDtypeStruct((1001, 33), jnp.float32), "ok": jnp.zeros((8, 4096))}
    mesh = mesh_of(fsdp=8)
    with pytest.raises(sh.ShardingError, match=r"odd \(1001, 33\) \(33,033 elements, 129.0 KiB\)"):
        sh.param_shardings(params, mesh, strict=True)
    with pytest.warns(sh.ShardingWarning, match="left replicated"):
        got = specs(sh.param_shardings(params, mesh))
    assert got == {"odd": P(), "ok": P(None, "fsdp")}
    # On a data-parallel mesh replication is the plan: nothing to say.
    sh.param_shardings(params, mesh_of(data=8), strict=True)


def test_indivisible_dimension_is_kept_whole_with_a_warning():
    abstract = jax.eval_shape(MLP(hidden=63).init, jax.random.key(0), jnp.zeros((1, 16)))
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    with pytest.raises(sh.ShardingError, match="dimension 1 of size 63 does not divide"):
        sh.param_shardings(abstract, mesh, RULES, strict=True, min_size=100)
    with pytest.warns(sh.ShardingWarning, match=r"params/fc/kernel \(16, 63\): dimension 1"):
        got = specs(sh.param_shardings(abstract, mesh, RULES, min_size=100))
    assert got["params"]["fc"]["kernel"] == P("fsdp")
    with pytest.raises(TypeError, match="neither"):
        sh.param_shardings(abstract, mesh, [("embed",)])


def test_a_parameter_left_whole_by_divisibility_is_reported_once():
    """On 3 devices nothing of 16 or 64 divides: one warning names each parameter (the
    first few), not a second one calling the same parameters replicated."""
    abstract = jax.eval_shape(MLP(hidden=64).init, jax.random.key(0), jnp.zeros((1, 16)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = specs(sh.param_shardings(abstract, mesh_of(data=1, fsdp=3), RULES, min_size=100))
    assert got["params"]["fc"]["kernel"] == P()
    (warning,) = [w for w in caught if issubclass(w.category, sh.ShardingWarning)]
    assert "do not divide" in str(warning.message)
    assert "left replicated" not in str(warning.message)


# ---------------------------------------------------------------- init and steps


def make_state(key, tx):
    params = MLP().init(key, jnp.zeros((1, 16)))["params"]
    return TrainState.create(params, tx, key)


def loss_fn(params, batch):
    out = MLP().apply({"params": params}, batch["x"])
    return jnp.mean((out - batch["y"]) ** 2)


def step(state, batch, tx):
    grads = jax.grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads, tx)


@pytest.fixture(scope="module")
def cube():
    return mesh_of(data=2, fsdp=2, tensor=2)


def cube_shardings(mesh, rules=RULES):
    return functools.partial(sh.param_shardings, mesh=mesh, rules=rules, min_size=0)


def test_init_sharded_creates_every_leaf_in_its_sharding(cube):
    tx = optax.adam(1e-2)
    init = functools.partial(make_state, tx=tx)
    state = sh.init_sharded(init, cube_shardings(cube), jax.random.key(0))
    expected = sh.state_shardings(jax.eval_shape(init, jax.random.key(0)), cube_shardings(cube))
    kernel = NamedSharding(cube, P("fsdp", "tensor"))
    mu, nu = state.opt_state[0].mu, state.opt_state[0].nu
    for leaf in (state.params, mu, nu):
        assert leaf["fc"]["kernel"].value.sharding == kernel  # Adam's moments follow params
    assert state.opt_state[0].count.sharding.is_fully_replicated
    assert state.step.sharding.is_fully_replicated
    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(expected), strict=True):
        assert x.sharding == s
        for shard in x.addressable_shards:  # each device holds its shard, no more
            assert shard.data.shape == s.shard_shape(x.shape)
    compiled = jax.jit(init, out_shardings=expected).lower(jax.random.key(0)).compile()
    assert jax.tree.leaves(compiled.output_shardings) == jax.tree.leaves(expected)
    whole = sh.bytes_per_device(jax.device_get(state))
    assert sh.bytes_per_device(state) < 0.3 * whole
    assert compiled.memory_analysis().output_size_in_bytes < 0.3 * whole
    # Same numbers as an unsharded init.
    plain = jax.jit(init)(jax.random.key(0))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(plain)):
        if not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


ADAM = optax.adam(1e-2)


@pytest.mark.parametrize(
    "rules",
    [RULES, [("embed", ("fsdp", "data"))]],  # the second: MaxText's form, several axes
    ids=["fsdp_tensor", "embed_over_fsdp_and_data"],
)
@pytest.mark.parametrize("tx", [optax.sgd(0.1), ADAM], ids=["sgd", "adam"])
def test_compiled_step_on_the_cube_equals_one_device(cube, tx, rules):
    init = functools.partial(make_state, tx=tx)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(12, 16)), "y": rng.normal(size=(12, 16))}
    batch = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sh.ShardingWarning)  # `mlp` has no rule here
        state = sh.init_sharded(init, cube_shardings(cube, rules), jax.random.key(0))
    shardings = jax.tree.map(lambda x: x.sharding, state)
    batch_sharding = NamedSharding(cube, P(DATA_AXES))
    sharded = jax.jit(
        functools.partial(step, tx=tx),
        in_shardings=(shardings, batch_sharding),
        out_shardings=shardings,
    )
    single = jax.jit(functools.partial(step, tx=tx))
    one = jax.device_put(jax.jit(init)(jax.random.key(0)), jax.devices()[0])
    for _ in range(3):
        state, one = sharded(state, batch), single(one, batch)
        for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
            assert x.sharding == s
    if tx is ADAM:  # Adam amplifies a rare rounding (tests/compare.py), up to its rate
        assert_trained_alike(state.params, one.params, atol=1e-6, worst=1e-2)
        return
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(one.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # two LM compiles (8 devices and one): 25 s of CPU, 77 s on a loaded host
def test_an_lm_whose_small_stacked_parameters_stay_whole_trains_like_one_device():
    # Kernels split over fsdp, the scanned stack's norms and biases (below min_size per
    # layer, above it stacked) whole on every device: their gradients are summed over
    # the replicas instead of reduce-scattered; AdamW's decay skips them either way.
    from experiments.lm import make_experiment
    from experiments.lm.task import make_preprocess, summarize
    from replicator.trainer.experiment import Settings
    from replicator.trainer.optimizer import OptimizerSpec, path_names

    model = dict(vocab_size=64, num_layers=4, num_heads=2, embed_dim=32, mlp_dim=64, max_len=32)
    spec = OptimizerSpec(name="adamw", learning_rate=3e-3, weight_decay=0.1, num_train_steps=3)
    rng = np.random.default_rng(0)
    batches = [make_preprocess(32)({"tokens": rng.integers(0, 64, (16, 33))}) for _ in range(3)]

    def train(repl):
        experiment = make_experiment(Settings(
            repl=repl, model=model, learning_rate=3e-3, optimizer="adamw", num_train_steps=3,
            grad_accum_steps=1, seed=0, optimizer_spec=spec,
        ))  # fmt: skip
        example = jax.tree.map(lambda x: x[0], batches[0])
        state = repl.init(experiment.init_state, jax.random.key(0), example)
        step, losses = repl.compile(experiment.train_step), []
        for batch in batches:
            state, sums = step(state, repl.shard_batch(batch))
            losses.append(summarize(jax.device_get(sums))["loss"])
        return losses, state.params

    losses, params = train(rp.Replicator(mesh={"fsdp": 8}, min_size=200))
    placed = dict(zip(path_names(params), (x.sharding.spec for x in jax.tree.leaves(params))))
    for name in ("ln_attention/scale", "attention/qkv_bias", "mlp/fc/bias"):  # 128-512 stacked
        assert placed[f"blocks/{name}"] == P(), name
    for name in ("attention/qkv_kernel", "mlp/fc/kernel", "mlp/proj/kernel"):
        assert "fsdp" in placed[f"blocks/{name}"], name
    one_losses, one_params = train(rp.Replicator(devices=jax.devices()[:1]))
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    assert_trained_alike(jax.device_get(params), jax.device_get(one_params))


# ------------------------------------------------------------------------ report


def test_report_counts_bytes_per_device():
    from experiments.lm.model import Transformer

    model = Transformer(
        vocab_size=256, num_layers=2, num_heads=4, embed_dim=128, max_len=128, scan_layers=False
    )
    tx = optax.adam(1e-3)

    def init(key):
        params = model.init(key, jnp.zeros((1, 8), jnp.int32))["params"]
        return TrainState.create(params, tx, key)

    abstract = jax.eval_shape(init, jax.random.key(0))
    placed = {}
    for name, sizes in {"data": {"data": 8}, "fsdp": {"fsdp": 8}}.items():
        mesh = mesh_of(**sizes)
        fn = functools.partial(sh.param_shardings, mesh=mesh)
        placed[name] = sh.attach_shardings(abstract, sh.state_shardings(abstract, fn))
    data_bytes = sh.bytes_per_device(placed["data"].params)
    fsdp_bytes = sh.bytes_per_device(placed["fsdp"].params)
    assert data_bytes == sum(x.size * 4 for x in jax.tree.leaves(abstract.params))
    assert data_bytes / 8 <= fsdp_bytes <= 0.15 * data_bytes
    assert sh.bytes_per_device(placed["fsdp"]) <= 0.3 * sh.bytes_per_device(placed["data"])

    mesh = mesh_of(fsdp=8)
    report = sh.sharding_report(
        placed["fsdp"], mesh, sh.plan_param_shardings(abstract.params, mesh)
    )
    assert "mesh data=1 fsdp=8 tensor=1 (8 devices)" in report
    rows = {line.split()[0]: line for line in report.splitlines() if line.strip()}
    assert sh.format_bytes(fsdp_bytes) in rows["params"]
    assert "opt_state" in rows and "total" in rows
    assert "Largest parameters left replicated, and why:" in report
    assert "params/block_0/mlp/fc/bias" in report  # the largest small one
    assert "('embed', 'fsdp'): 10 parameters" in report
    assert "below min_size: replicated" in report
    # Without a plan: parameters grouped by their spec.
    assert "P(None, 'fsdp'): " in sh.sharding_report(placed["fsdp"], mesh)


# ------------------------------------------------------------------- checkpoints


def test_checkpoint_restores_exactly_across_four_meshes(tmp_path):
    tx = optax.adam(1e-2)
    init = functools.partial(make_state, tx=tx)
    abstract = jax.eval_shape(init, jax.random.key(0))
    chain = [{"data": 8}, {"fsdp": 8}, {"data": 2, "fsdp": 2, "tensor": 2}, {"data": 1}]
    devices = [jax.devices(), jax.devices(), jax.devices(), jax.devices()[:1]]
    repl = rp.Replicator(devices=devices[0], mesh=chain[0])
    state = sh.init_sharded(init, cube_shardings(repl.mesh), jax.random.key(0))
    expected = jax.device_get(state)
    for step, (sizes, devs) in enumerate(zip(chain[1:], devices[1:]), start=1):
        with rp.Checkpoints(tmp_path / str(step), repl) as ckpt:
            ckpt.save(step, state)
            ckpt.wait()
        repl = rp.Replicator(devices=devs, mesh=sizes)
        target = sh.state_shardings(abstract, cube_shardings(repl.mesh))
        with rp.Checkpoints(tmp_path / str(step), repl, read_only=True) as ckpt:
            state = ckpt.restore(like=sh.attach_shardings(abstract, target))
        for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(target), strict=True):
            assert x.sharding == s, sizes
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
            if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
                a, b = jax.random.key_data(a), jax.random.key_data(b)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert state.params["fc"]["kernel"].value.sharding.mesh.devices.size == 1


# ------------------------------------------------------------------- multi-slice


@dataclasses.dataclass(frozen=True)
class StandInTpu:
    """What mesh_utils reads of a TPU device (as JAX's own mesh_utils tests fake them)."""

    id: int
    coords: tuple[int, int, int]
    slice_index: int
    process_index: int = 0
    core_on_chip: int = 0
    platform: str = "tpu"
    device_kind: str = "TPU v4"


def stand_in_slices(slices, x=2, y=2, z=1):
    return [
        StandInTpu(id=s * x * y * z + i, coords=(i % x, i // x % y, i // (x * y)), slice_index=s)
        for s in range(slices)
        for i in range(x * y * z)
    ]


def test_hybrid_mesh_keeps_fsdp_and_tensor_inside_a_slice():
    devices = stand_in_slices(2)
    array = hybrid_mesh_devices({"fsdp": 2, "tensor": 2}, {"data": 2}, devices)
    assert array.shape == (2, 2, 2)
    for d in range(2):  # each data row is one slice: only `data` crosses slices
        assert {dev.slice_index for dev in array[d].flat} == {d}
    assert sorted(dev.id for dev in array.flat) == list(range(8))
    array = hybrid_mesh_devices({"fsdp": -1}, None, stand_in_slices(4))
    assert array.shape == (4, 4, 1)
    with pytest.raises(ValueError, match="4"):
        hybrid_mesh_devices({"fsdp": 4}, {"data": 4}, devices)


def test_replicator_dcn_mesh_groups_devices_by_host_without_slices():
    """GPUs and CPUs carry no slice_index: each process is one group (one here)."""
    repl = rp.Replicator(mesh={"fsdp": 4, "tensor": 2}, dcn_mesh={"data": 1})
    assert dict(repl.mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert repl.axis_name == ("fsdp",)
    with pytest.raises(ValueError, match="2 devices but 1"):
        rp.Replicator(mesh={"fsdp": 4, "tensor": 2}, dcn_mesh={"data": 2})
