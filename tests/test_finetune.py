"""big_vision's fine-tuning semantics in the trainer: frozen parameters outside the
clip, the gradient norm and the backward pass; init_from_skip (``dont_load``);
lr_mults; the learning rate following the batch size."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator import trainer
from replicator.checkpoints.checkpoint import Checkpoints
from replicator.compiled import hlo as hlo
from replicator.trainer import init_from
from replicator.trainer.optimizer import OptimizerSpec, describe, make_optimizer, mark_frozen
from replicator.trainer.setup import setup, train_params
from tests.helpers.configs import CONFIG_DIR, load_config, read_records

CLIP = 0.5
FREEZE = "backbone"


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "backbone": {"kernel": jax.random.normal(k1, (16, 64)) * 0.3},
        "head": {"kernel": jax.random.normal(k2, (64, 4)) * 0.3, "bias": jnp.zeros(4)},
    }


def loss_fn(params, batch):
    features = jnp.tanh(batch["x"] @ params["backbone"]["kernel"])
    out = features @ params["head"]["kernel"] + params["head"]["bias"]
    return rp.compute_average_loss(jnp.sum((out - batch["y"]) ** 2, -1))


def a_batch():
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(32, 16)).astype(np.float32),
        "y": rng.normal(size=(32, 4)).astype(np.float32),
    }


def one_step(repl, path, spec, accum, aggregate=None):
    """One trainer step (the trainer's optimizer, its frozen marks) of ``spec``: the
    state before and after, and the compiled step's FLOPs."""
    tx = repl.wrap_optimizer(
        make_optimizer(spec), clip_norm=spec.grad_clip_norm, track_norm=True, aggregate=aggregate
    )
    with repl.context():
        state = repl.init(
            lambda: mark_frozen(
                rp.TrainState.create(init_params(), tx, jax.random.key(1), grad_accum_steps=accum),
                spec.freeze,
            )
        )

    def step(state, batch):
        _, grads = state.value_and_grad(loss_fn, batch)
        return state.apply_gradients(grads, tx)

    batch = repl.shard_batch(a_batch())
    if path == "run":
        new = repl.run(step, state, batch)
        program = repl.lower(step, state, batch).compile().as_text()
    else:
        compiled = repl.compile(step)
        new, program = compiled(state, batch), compiled.lower(state, batch).compile().as_text()
    return state, new, hlo.analyze(program).flops


@pytest.mark.parametrize(
    "path, mesh, accum, aggregate",
    [
        ("run", {"data": 8}, 1, None),
        ("compile", {"data": 2, "fsdp": 4}, 2, None),
        ("run", {"data": 2, "fsdp": 4}, 2, None),
        ("run", {"data": 4, "fsdp": 2}, 1, rp.narrow_sum(jnp.float32)),
    ],
)
def test_frozen_parameters_are_outside_the_clip_the_norm_and_the_backward_pass(
    path, mesh, accum, aggregate
):
    repl = rp.Replicator(mesh=mesh, min_size=0)
    spec = OptimizerSpec(name="sgd", learning_rate=0.1, grad_clip_norm=CLIP, freeze=FREEZE)
    before, after, flops = one_step(repl, path, spec, accum, aggregate)
    _, unfrozen, full_flops = one_step(repl, path, OptimizerSpec(name="sgd"), accum, aggregate)

    # big_vision: optax.masked(clip_by_global_norm(c), not_frozen) before the optimizer.
    params = jax.device_get(before.params)
    grads = jax.grad(loss_fn)(params, a_batch())
    trained = jax.tree.map(lambda _: True, params) | {"backbone": {"kernel": False}}
    theirs = optax.chain(
        optax.masked(optax.clip_by_global_norm(CLIP), trained), make_optimizer(spec)
    )
    updates, _ = theirs.update(grads, theirs.init(params), params)
    want = optax.apply_updates(params, updates)
    got = jax.device_get(after.params)
    np.testing.assert_allclose(got["head"]["kernel"], want["head"]["kernel"], atol=1e-6)
    np.testing.assert_allclose(got["head"]["bias"], want["head"]["bias"], atol=1e-6)
    np.testing.assert_array_equal(got["backbone"]["kernel"], params["backbone"]["kernel"])
    head_norm = optax.global_norm(grads["head"])
    assert float(rp.grad_norm(after)) == pytest.approx(float(head_norm), rel=1e-5)
    assert float(head_norm) > CLIP  # (so that the clip was at work)
    assert float(rp.grad_norm(unfrozen)) > float(head_norm) * 1.1
    # The backbone's weight gradient, and the backward pass into it, are gone.
    assert flops < full_flops * 0.6, (flops, full_flops)


def digits(data_dir, **overrides):
    config = load_config(CONFIG_DIR / "digits_cnn.py", "smoke")
    config.update(data_dir=data_dir, **overrides)
    return config


PROBE = "^(?!Dense_1/)"  # everything but the classifier


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_a_linear_probe_costs_fewer_flops_per_step(tmp_path, digits_data_dir):
    steps = dict(num_train_steps=2, eval_every_steps=2, checkpoint_every_steps=2)
    summaries = {}
    for name, freeze in (("full", None), ("probe", PROBE)):
        config = digits(digits_data_dir, freeze=freeze, grad_clip_norm=1.0, **steps)
        trainer.train_and_evaluate(config, str(tmp_path / name), quiet=True)
        (summary,) = [r for r in read_records(tmp_path / name) if r.get("split") == "summary"]
        summaries[name] = summary["flops_per_step"]
    # The convolutions' weight gradients and the backward pass through them are gone:
    # the probe's step is the forward pass and the head's backward.
    assert 0 < summaries["probe"] < 0.5 * summaries["full"], summaries
    # A frozen run resumes from its checkpoint (the state's frozen marks are no arrays).
    config = digits(digits_data_dir, freeze=PROBE, **steps | dict(num_train_steps=3))
    trainer.train_and_evaluate(config, str(tmp_path / "probe"), quiet=True)
    assert [r["step"] for r in read_records(tmp_path / "probe") if "split" not in r] == [2, 3]


def test_lr_mults_multiply_the_scheduled_rate_first_match_wins():
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), init_params())
    schedule = dict(name="sgd", learning_rate=0.1, lr_schedule="cosine", warmup_steps=2,
                    num_train_steps=10)  # fmt: skip
    mults = (("backbone", 0.1), ("kernel", 3.0))  # the backbone's kernel: 0.1, first match
    plain, scaled = (make_optimizer(OptimizerSpec(**schedule, lr_mults=m)) for m in ((), mults))
    params = init_params()
    plain_state, scaled_state = plain.init(params), scaled.init(params)
    for _ in range(5):
        ups, plain_state = plain.update(grads, plain_state, params)
        mult_ups, scaled_state = scaled.update(grads, scaled_state, params)
        np.testing.assert_allclose(
            mult_ups["backbone"]["kernel"], 0.1 * ups["backbone"]["kernel"], rtol=1e-6
        )
        np.testing.assert_allclose(mult_ups["head"]["kernel"], 3 * ups["head"]["kernel"], rtol=1e-6)
        np.testing.assert_array_equal(mult_ups["head"]["bias"], ups["head"]["bias"])


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_lr_mults_in_a_run_move_the_backbone_a_tenth_and_say_what_they_took(digits_data_dir):
    """Under SGD the 0.1x parameters move exactly a tenth of what they move at 1x."""
    moved, said = {}, ""
    for name, mults in (("plain", None), ("mults", (("^Conv_", 0.1),))):
        config = digits(digits_data_dir, optimizer="sgd", learning_rate=0.05, lr_mults=mults)
        run = setup(config)
        state = run.init_state()
        batch = next(run.repl.distribute(run.train_iterator()))
        new, _, _ = run.train_step(jax.tree.map(jnp.copy, state), batch)
        moved[name] = jax.tree.map(
            lambda a, b: np.asarray(a) - np.asarray(b), new.params, state.params
        )
        said = describe(run.optimizer_spec, train_params(run.abstract_state)[0])  # the log's
        run.close()
    for layer in ("Conv_0", "Conv_1"):
        np.testing.assert_allclose(
            moved["mults"][layer]["kernel"], 0.1 * moved["plain"][layer]["kernel"],
            rtol=1e-3, atol=1e-7,  # (the rounding of a parameter of about 0.3)
        )  # fmt: skip
    np.testing.assert_allclose(moved["mults"]["Dense_1"]["kernel"],
                               moved["plain"]["Dense_1"]["kernel"], rtol=1e-5)  # fmt: skip
    line = said.splitlines()[1]
    assert line.startswith("lr_mults: '^Conv_' x0.1 on 18,816 parameters (4 arrays); the other")


@pytest.mark.parametrize("scaling, factor", [("linear", 4.0), ("sqrt", 2.0)])
def test_the_optimizer_applies_the_batch_scaled_rate(scaling, factor):
    lr = 2e-3
    spec = OptimizerSpec(name="sgd", learning_rate=lr, batch_size=64, lr_base_batch_size=16,
                         lr_batch_scaling=scaling, lr_schedule="cosine",
                         num_train_steps=10)  # fmt: skip
    tx, ones = make_optimizer(spec), {"w": jnp.ones(3)}
    np.testing.assert_allclose(tx.update(ones, tx.init(ones))[0]["w"], -lr * factor, rtol=1e-6)
    assert float(spec.schedule()(10)) == 0.0 and spec.batch_factor == factor
    unscaled = OptimizerSpec(learning_rate=lr, batch_size=64, lr_base_batch_size=16)
    assert unscaled.batch_factor == 1.0  # (a base without a scaling: the rate as given)


def test_a_run_logs_and_prints_the_batch_scaled_rate(tmp_path, digits_data_dir, caplog):
    lr, factor = 2e-3, 4.0  # batch 64 against a base of 16, linear
    config = digits(digits_data_dir, batch_size=64, lr_base_batch_size=16,
                    lr_batch_scaling="linear", num_train_steps=2, log_every_steps=1)  # fmt: skip
    with caplog.at_level("INFO", logger="replicator"):
        trainer.train_and_evaluate(config, str(tmp_path), quiet=True)
    records = [r for r in read_records(tmp_path) if "split" not in r]
    assert [r["learning_rate"] for r in records] == pytest.approx([lr * factor] * 2)
    said = f"constant learning rate {lr * factor:g} ({lr:g} x {factor:g}, linear in batch_size 64"
    assert any(said in r.message for r in caplog.records), [r.message for r in caplog.records]


@pytest.fixture(scope="module")
def source_run(tmp_path_factory, digits_data_dir):
    workdir = tmp_path_factory.mktemp("source")
    config = digits(digits_data_dir, num_train_steps=2, eval_every_steps=2)
    trainer.train_and_evaluate(config, str(workdir), quiet=True)
    return workdir


def test_init_from_skip_leaves_what_it_finds_fresh_and_loads_the_rest(
    tmp_path, digits_data_dir, source_run, capsys
):
    """A new head of another shape, without renaming it away: ``dont_load``."""
    config = digits(digits_data_dir, init_from=str(source_run), init_from_skip="^params/Dense_",
                    model={**digits(digits_data_dir).model, "dense_features": 32})  # fmt: skip
    run = setup(config)
    fresh = run.init_state()
    plan = init_from.plan(config.init_from, None, run.abstract_state, run.repl,
                          config.init_from_skip)  # fmt: skip
    state = init_from.place(plan, init_from.read(plan, run.abstract_state, run.repl), fresh)
    source = Checkpoints(str(source_run / "checkpoints"), run.repl, read_only=True)
    convs = {k: v for k, v in run.abstract_state.params.items() if k.startswith("Conv_")}
    saved = source.restore(like={"params": convs}, partial=True)
    source.close()
    for layer in ("Dense_0", "Dense_1"):  # initialised as without init_from, bit for bit
        for key in ("kernel", "bias"):
            np.testing.assert_array_equal(state.params[layer][key], fresh.params[layer][key])
    for layer in ("Conv_0", "Conv_1"):  # the checkpoint's
        for key in ("kernel", "bias"):
            np.testing.assert_array_equal(state.params[layer][key], saved["params"][layer][key])
    assert plan.skipped == sorted(
        f"params/Dense_{i}/{k}" for i in (0, 1) for k in ("bias", "kernel")
    )
    run.close()
    # Through the Python entry: the line on stderr, every path in log.txt.
    config.num_train_steps = 1
    trainer.train_and_evaluate(config, str(tmp_path / "tuned"), quiet=True)
    err = capsys.readouterr().err
    assert "loaded 4 arrays, 4 initialised fresh (4 by init_from_skip), 4 in the checkpoint" in err
    log_text = (tmp_path / "tuned" / "log.txt").read_text()
    assert "params/Dense_1/kernel (init_from_skip)" in log_text
    assert "params/Conv_0/kernel" in log_text


def test_init_from_skip_that_finds_nothing_is_one_error():
    saved = {"params/enc/w": (3, 4), "params/head/w": (4, 2)}
    wanted = {"params/enc/w": jax.ShapeDtypeStruct((3, 4), jnp.float32),
              "params/head/w": jax.ShapeDtypeStruct((4, 5), jnp.float32)}  # fmt: skip
    with pytest.raises(rp.UserError, match=r"init_from_skip='\^params/heads/' matches no path"):
        init_from._match("d", 1, saved, wanted, (), "^params/heads/")
    plan = init_from._match("d", 1, saved, wanted, (), "^params/head/")
    assert plan.sources == {"params/enc/w": "params/enc/w"} and plan.skipped == ["params/head/w"]


BAD = [
    (dict(lr_batch_scaling="cube", lr_base_batch_size=32),
     "'lr_batch_scaling'='cube' is not one of"),
    (dict(lr_batch_scaling="linear"), "'lr_batch_scaling'='linear' needs 'lr_base_batch_size'"),
    (dict(lr_mults=("Conv", 0.1)), "'lr_mults'=('Conv', 0.1) must be (regex, factor) pairs"),
    (dict(lr_mults=(("Conv", 0.0),)), "must be > 0 (to train nothing there, use 'freeze')"),
    (dict(lr_mults=(("Conv[", 2.0),)), "'lr_mults' has 'Conv[', not a regex"),
    (dict(lr_mults=(("^Conv", 2.0), ("Conv_0", 3.0))), "('Conv_0', 3.0) takes no parameter"),
    (dict(lr_mults=(("^conv", 2.0),)), "('^conv', 2.0) takes no parameter"),
    (dict(init_from_skip="Dense_["), "'init_from_skip'='Dense_[' is not a regex"),
]  # fmt: skip


@pytest.mark.parametrize("overrides, message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_fine_tuning_keys_are_one_config_error(digits_data_dir, overrides, message):
    with pytest.raises(rp.UserError) as error:
        setup(digits(digits_data_dir, **overrides)).close()
    assert message in str(error.value)
