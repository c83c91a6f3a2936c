"""The config's optimizer keys: schedules, optimizer arguments, weight decay, clipping,
EMA, fine-tuning from another run, freezing; through the CLI where a user meets them."""

import json
import os
import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import replicator as rp
from replicator.trainer.optimizer import OptimizerSpec, make_optimizer, make_schedule
from tests.compare import assert_trained_alike
from tests.helpers.cli import SMOKE, assert_one_line_error, run_cli
from tests.helpers.configs import read_records
from tests.test_checkpoint import finish, start_train, wait_for
from tests.test_lm_program import _stacked

LR = 2e-3  # configs/digits_cnn.py's
ROOT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "digits_cnn.py")


# ---- The chain, as optax pieces.


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear", "rsqrt"])
def test_schedules_start_at_zero_peak_after_warmup_and_end_where_asked(kind):
    s = make_schedule(kind, 1.0, 10, 110, 0.2)
    assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5)
    assert float(s(10)) == pytest.approx(1.0)
    end = {"constant": 1.0, "cosine": 0.2, "linear": 0.2, "rsqrt": (10 / 110) ** 0.5}[kind]
    assert float(s(110)) == pytest.approx(end, rel=1e-6)


def test_cosine_with_warmup_is_optax_warmup_cosine():
    ours = make_schedule("cosine", LR, 4, 40, 0.1)
    theirs = optax.warmup_cosine_decay_schedule(0.0, LR, 4, 40, 0.1 * LR)
    for count in range(41):
        assert float(ours(count)) == pytest.approx(float(theirs(count)), rel=1e-6, abs=1e-12)


def grads_like(params):
    return jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)


PARAMS = {"dense": {"kernel": jnp.full((3, 4), 2.0), "bias": jnp.full((4,), 2.0)}}


def one_update(spec):
    tx = make_optimizer(spec)
    state = tx.init(PARAMS)
    updates, state = tx.update(grads_like(PARAMS), state, PARAMS)
    return updates, state


def test_optimizer_args_reach_the_alias():
    spec = OptimizerSpec(name="sgd", learning_rate=0.1, args={"momentum": 0.9, "nesterov": True})
    updates, _ = one_update(spec)
    tx = optax.sgd(0.1, momentum=0.9, nesterov=True)
    want, _ = tx.update(grads_like(PARAMS), tx.init(PARAMS), PARAMS)
    jax.tree.map(np.testing.assert_array_equal, updates, want)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_weight_decay_is_decoupled_scaled_by_the_rate_and_skips_vectors(name):
    decayed, _ = one_update(OptimizerSpec(name=name, learning_rate=0.1, weight_decay=0.5))
    plain, _ = one_update(OptimizerSpec(name=name, learning_rate=0.1, weight_decay=0.0))
    # lr * wd * p = 0.1 * 0.5 * 2.0 on the kernel; nothing on the bias.
    np.testing.assert_allclose(decayed["dense"]["kernel"] - plain["dense"]["kernel"], -0.1)
    np.testing.assert_array_equal(decayed["dense"]["bias"], plain["dense"]["bias"])
    masked, _ = one_update(
        OptimizerSpec(name=name, learning_rate=0.1, weight_decay=0.5, weight_decay_mask="bias")
    )
    np.testing.assert_allclose(masked["dense"]["bias"] - plain["dense"]["bias"], -0.1)
    np.testing.assert_array_equal(masked["dense"]["kernel"], plain["dense"]["kernel"])


def test_frozen_parameters_get_no_update_and_hold_no_optimizer_state():
    updates, state = one_update(OptimizerSpec(freeze="bias"))
    np.testing.assert_array_equal(updates["dense"]["bias"], 0.0)
    assert np.all(np.asarray(updates["dense"]["kernel"]) != 0.0)
    sizes = [x.size for x in jax.tree.leaves(state)]
    _, unfrozen = one_update(OptimizerSpec())
    # Adam's two moments of the kernel alone: 2 * 12, plus its counts.
    assert sum(sizes) == sum(x.size for x in jax.tree.leaves(unfrozen)) - 2 * 4


def test_ema_averages_the_new_parameters_in_the_optimizer_state():
    spec = OptimizerSpec(name="sgd", learning_rate=1.0, ema_decay=0.75)
    updates, state = one_update(spec)
    new = optax.apply_updates(PARAMS, updates)  # 2.0 - 0.5 = 1.5
    ema = rp.ema.ema_params(state)
    np.testing.assert_allclose(ema["dense"]["kernel"], 0.75 * 2.0 + 0.25 * 1.5)
    np.testing.assert_array_equal(new["dense"]["kernel"], 1.5)


# ---- Through the CLI, on the digits.


def train_cli(workdir, data_dir, *extra, devices=2):
    return run_cli(
        "train", *SMOKE, "--workdir", str(workdir), f"--config.data_dir={data_dir}", "--quiet",
        *extra, devices=devices,
    )  # fmt: skip


def test_logged_learning_rate_follows_warmup_and_cosine_and_grad_norm_is_logged(
    tmp_path, digits_data_dir
):
    done = train_cli(
        tmp_path / "run", digits_data_dir,
        "--config.num_train_steps=12", "--config.log_every_steps=1",
        "--config.lr_schedule=cosine", "--config.warmup_steps=4",
        "--config.lr_end_fraction=0.1", "--config.grad_clip_norm=0.5",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = [r for r in read_records(tmp_path / "run") if "split" not in r]
    assert [r["step"] for r in records] == list(range(1, 13))
    want = optax.warmup_cosine_decay_schedule(0.0, LR, 4, 12, 0.1 * LR)
    for r in records:  # the rate the step's update used: the schedule at updates before it
        assert r["learning_rate"] == pytest.approx(float(want(r["step"] - 1)), rel=1e-6, abs=0)
        assert np.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
    assert "parameters " in done.stderr and "cosine learning rate 0.002" in done.stderr
    from tests.test_checkpoint import tensorboard_scalars

    shown = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert [s for s, _ in shown["train/learning_rate"]] == list(range(1, 13))


EMA_FLAGS = (  # 120 steps: checkpoints every 40, evals every 60
    "--config.ema_decay=0.9",
    "--config.num_train_steps=120",
    "--config.checkpoint_every_steps=40",
    "--config.eval_every_steps=60",
)


def ema_leaves(workdir):
    """The EMA in the last checkpoint's optimizer state, read with plain Orbax."""
    directory = workdir / "checkpoints"
    step = max(int(d.name) for d in directory.iterdir() if d.name.isdigit())
    path = directory / str(step) / "state"
    handler = ocp.PyTreeCheckpointHandler()
    tree = handler.metadata(path).tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    restored = ocp.Checkpointer(handler).restore(
        path, args=ocp.args.PyTreeRestore(tree, restore_args=as_numpy)
    )
    flat = jax.tree_util.tree_flatten_with_path(restored["opt_state"])[0]
    found = {jax.tree_util.keystr(p): x for p, x in flat if "ema" in jax.tree_util.keystr(p)}
    assert found, "no EMA in the checkpoint's optimizer state"
    return step, found


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory, digits_data_dir):
    workdir = tmp_path_factory.mktemp("ema") / "run"
    code, out, err = finish(start_train(workdir, digits_data_dir, *EMA_FLAGS))
    assert code == 0, err[-3000:]
    return workdir


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_ema_metrics_and_ema_survive_kill_and_resume_bitwise(tmp_path, digits_data_dir, ema_run):
    evals = [r for r in read_records(ema_run) if r.get("split") == "test"]
    assert [r["step"] for r in evals] == [60, 120]
    for r in evals:
        assert 0 < r["ema_accuracy"] <= 1 and np.isfinite(r["ema_loss"])
        assert r["ema_accuracy"] != r["accuracy"] or r["ema_loss"] != r["loss"]
    workdir = tmp_path / "killed"
    proc = start_train(workdir, digits_data_dir, *EMA_FLAGS)
    wait_for(lambda: (workdir / "checkpoints" / "40").exists(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    code, out, err = finish(start_train(workdir, digits_data_dir, *EMA_FLAGS))
    assert code == 0, err[-3000:]
    assert "Resumed from step" in err
    step, ema = ema_leaves(workdir)
    ref_step, ref_ema = ema_leaves(ema_run)
    assert step == ref_step == 120 and ema.keys() == ref_ema.keys()
    for key in ema:
        np.testing.assert_array_equal(ema[key], ref_ema[key])
    assert [r for r in read_records(workdir) if r.get("split") == "test"] == evals


def test_eval_ema_evaluates_only_the_average(ema_run):
    done = run_cli("eval", "--workdir", str(ema_run), "--ema", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    last = [r for r in read_records(ema_run) if r.get("split") == "test"][-1]
    assert result["ema_accuracy"] == last["ema_accuracy"] and "accuracy" not in result
    assert result["num_examples"] == 360


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_init_from_with_freeze_reproduces_the_source_eval(tmp_path, digits_data_dir, ema_run):
    done = train_cli(
        tmp_path / "tuned", digits_data_dir,
        f"--config.init_from={ema_run}:120", "--config.freeze=.*",
        "--config.num_train_steps=2", "--config.eval_every_steps=1", "--config.ema_decay=0.5",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"init_from {ema_run}/checkpoints step 120: loaded " in done.stderr
    source = [r for r in read_records(ema_run) if r.get("split") == "test"][-1]
    first = [r for r in read_records(tmp_path / "tuned") if r.get("split") == "test"][0]
    assert (first["accuracy"], first["loss"]) == (source["accuracy"], source["loss"])
    # The new run's EMA starts from the loaded parameters: nothing trains, so it is them.
    assert (first["ema_accuracy"], first["ema_loss"]) == (source["accuracy"], source["loss"])
    log = (tmp_path / "tuned" / "log.txt").read_text()
    assert "params/Dense_0/kernel" in log and "in the checkpoint, unused" in log


@pytest.fixture(scope="module")
def corrupt_run(tmp_path_factory, ema_run):
    """A copy of the EMA run whose newest checkpoint's arrays are garbage."""
    import shutil

    copy = tmp_path_factory.mktemp("corrupt") / "run"
    shutil.copytree(ema_run / "checkpoints", copy / "checkpoints")
    for root, _, files in os.walk(copy / "checkpoints" / "120" / "state"):
        for name in files:
            if not name.endswith(".json") and "metadata" not in name:
                with open(os.path.join(root, name), "r+b") as f:
                    f.write(b"\0garbage" * 16)
    return copy


# Through the command line: one line, nothing written. A config key that validation
# refuses (the first) stands for the others below, which validation refuses alike.
BAD = [
    (["--config.weight_decay=-0.1"], ["'weight_decay' must be >= 0.0"]),
    (["--config.freeze=^nothing_like_this"], ["matches no parameter path", "Dense_0/kernel"]),
    (["--config.optimizer=adam", "--config.optimizer_args={'momentum': 0.9}"],
     ["'optimizer_args' has ['momentum']", "optax.adam takes"]),
    (["--config.init_from=/nonexistent/run"], ["config.init_from='/nonexistent/run'"]),
    (["--config.lr_mults=(('^nothing', 0.1),)"], ["('^nothing', 0.1) takes no parameter",
                                                  "Dense_0/kernel"]),
]  # fmt: skip
# Refused by `config.validate`, before a workdir or JAX is touched: checked in-process.
INVALID = [
    ({"lr_schedule": "cosin"}, "'lr_schedule'='cosin' is not one of"),
    ({"warmup_steps": 999}, "'warmup_steps'=999 is more than 'num_train_steps'"),
    ({"ema_decay": 1.5}, "'ema_decay' must be in (0, 1)"),
    ({"weight_decay_mask": "kernel"}, "'weight_decay' is 0: nothing is decayed"),
    ({"lr_batch_scaling": "cube", "lr_base_batch_size": 32}, "'lr_batch_scaling'='cube' is not"),
]


@pytest.mark.parametrize("flags, expected", BAD, ids=[f[0] for f, _ in BAD])
def test_bad_optimizer_keys_are_one_line_and_write_nothing(
    tmp_path, digits_data_dir, flags, expected
):
    workdir = tmp_path / "run"
    done = train_cli(workdir, digits_data_dir, *flags)
    assert_one_line_error(done, *expected)
    assert not workdir.exists()


@pytest.mark.parametrize("overrides, expected", INVALID, ids=[str(o) for o, _ in INVALID])
def test_bad_optimizer_keys_are_refused_by_validation(overrides, expected):
    import importlib.util

    from replicator.errors import ConfigError
    from replicator.trainer import config as config_lib

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "digits_cnn.py")
    spec = importlib.util.spec_from_file_location("digits_cnn", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("smoke")
    config.update(overrides)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        config_lib.validate(config)


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_bad_init_from_sources_are_one_line_and_write_nothing(
    tmp_path, digits_data_dir, ema_run, corrupt_run
):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ([f"--config.init_from={empty}"], ["holds no checkpoint"]),
        ([f"--config.init_from={ema_run}:7"], ["no step 7"]),
        ([f"--config.init_from={corrupt_run}"], ["config.init_from"]),
        ([f"--config.init_from={ema_run}", "--config.model.dense_features=32"],
         ["other shapes in the checkpoint", "params/Dense_0/kernel"]),
    ]  # fmt: skip
    for flags, expected in cases:
        workdir = tmp_path / "run"
        done = train_cli(workdir, digits_data_dir, *flags)
        assert_one_line_error(done, *expected)
        assert not workdir.exists(), flags


# ---- grad_reduce_dtype: the cross-replica sum in bfloat16, in the trainer.


@pytest.mark.parametrize(
    "name, steps, metric, tolerance",
    [
        pytest.param("digits_cnn", 60, "accuracy", 0.03, marks=pytest.mark.slow),
        pytest.param("lm_tiny", 20, "loss", 0.02, marks=pytest.mark.slow),  # 11 s
    ],
)
def test_a_bf16_gradient_sum_trains_like_a_float32_one(
    tmp_path, digits_data_dir, name, steps, metric, tolerance
):
    from replicator import trainer
    from tests.helpers.configs import CONFIG_DIR, load_config

    results = {}
    for dtype in (None, "bf16"):
        config = load_config(CONFIG_DIR / f"{name}.py", "smoke")
        config.update(
            num_train_steps=steps, eval_every_steps=steps, checkpoint_every_steps=steps,
            log_every_steps=steps, grad_reduce_dtype=dtype, data_dir=digits_data_dir,
        )  # fmt: skip
        results[dtype] = trainer.train_and_evaluate(config, str(tmp_path / str(dtype)), quiet=True)
    f32, bf16 = results[None][metric], results["bf16"][metric]
    assert np.isfinite(bf16) and abs(bf16 - f32) <= tolerance * max(abs(f32), 1.0), (f32, bf16)


def test_init_from_rules_rename_checkpoint_paths_and_the_plan_says_what_happened():
    from replicator.trainer.init_from import _match

    saved = {"params/enc/w": (3, 4), "params/head/w": (4, 2), "opt_state/0/mu/enc/w": (3, 4)}
    wanted = {
        "params/backbone/w": jax.ShapeDtypeStruct((3, 4), jnp.float32),
        "params/head/w": jax.ShapeDtypeStruct((4, 5), jnp.float32),
        "params/new/b": jax.ShapeDtypeStruct((5,), jnp.float32),
    }
    with pytest.raises(rp.UserError, match=r"params/head/w \(4, 5\) <- params/head/w \(4, 2\)"):
        _match("d", 1, saved, wanted, [("^params/enc/", "params/backbone/")])
    del wanted["params/head/w"]
    plan = _match("d", 1, saved, wanted, [("^params/enc/", "params/backbone/")])
    assert plan.sources == {"params/backbone/w": "params/enc/w"}
    assert plan.fresh == ["params/new/b"] and plan.unused == ["params/head/w"]
    assert "loaded 1 arrays, 1 initialised fresh, 1 in the checkpoint unused" in plan.report()
    with pytest.raises(rp.UserError, match="'\\^params/dec/' matches no path"):
        _match("d", 1, saved, wanted, [("^params/dec/", "params/backbone/")])
    with pytest.raises(rp.UserError, match="rename both"):
        _match("d", 1, saved, wanted, [("^params/[a-z]+/", "params/x/")])


# ---- Every experiment, both step paths, a sharded mesh.

EVERYTHING = dict(
    lr_schedule="cosine", warmup_steps=1, weight_decay=0.01, grad_clip_norm=1.0,
    ema_decay=0.5, num_train_steps=3, eval_every_steps=3, checkpoint_every_steps=3,
    log_every_steps=1,
)  # fmt: skip


@pytest.mark.parametrize(
    "name, step_path, mesh, freeze",
    [
        ("digits_cnn", "compile", {"data": 2, "fsdp": 4}, "Dense_1"),
        pytest.param(
            "digits_nnx_cnn", "run", {"data": 2, "fsdp": 4}, "conv1", marks=pytest.mark.slow
        ),
        pytest.param("lm_tiny", "run", {"data": 4, "fsdp": 2}, "ln_final", marks=pytest.mark.slow),
        pytest.param("gan_digits", "compile", {"data": 8}, "Dense_0", marks=pytest.mark.slow),
    ],  # (digits_cnn on every make test)
)
def test_every_experiment_takes_the_optimizer_keys_on_both_paths(
    tmp_path, digits_data_dir, name, step_path, mesh, freeze
):
    from replicator import trainer
    from replicator.trainer.setup import setup, train_params
    from tests.helpers.configs import CONFIG_DIR, load_config

    config = load_config(CONFIG_DIR / f"{name}.py", "smoke")
    config.update(EVERYTHING, step_path=step_path, mesh=mesh, freeze=freeze,
                  data_dir=digits_data_dir, fsdp_min_size=0)  # fmt: skip
    run = setup(config)
    # The EMA lies where its parameter does: same sharding, leaf for leaf.
    shardings = jax.tree_util.tree_flatten_with_path(run.state_shardings)[0]
    by_path = {jax.tree_util.keystr(p): s for p, s in shardings}
    emas = {k: s for k, s in by_path.items() if ".ema" in k}
    assert emas
    for key, sharding in emas.items():
        param = next(p for p in by_path if p.endswith(key.split(".ema")[1]) and ".params" in p)
        assert sharding == by_path[param], key
    run.close()
    result = trainer.train_and_evaluate(config, str(tmp_path / "run"), quiet=True)
    records = [r for r in read_records(tmp_path / "run") if "split" not in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["learning_rate"] == 0.0 and records[1]["learning_rate"] > 0
    assert all(np.isfinite(r["grad_norm"]) for r in records)
    ema_metrics = [k for k in result if k.startswith("ema_")]
    assert ema_metrics and all(np.isfinite(result[k]) for k in ema_metrics)
    assert train_params(run.abstract_state)


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_a_resumed_fine_tune_needs_no_source(tmp_path, digits_data_dir, ema_run):
    """A fine-tune resumes from its own checkpoints: its source may be gone by then
    (pruned, moved); init_from is read only by a run that starts afresh."""
    import shutil

    source = tmp_path / "source"
    shutil.copytree(ema_run / "checkpoints", source / "checkpoints")
    flags = [f"--config.init_from={source}", "--config.checkpoint_every_steps=2"]
    done = train_cli(tmp_path / "tuned", digits_data_dir, *flags, "--config.num_train_steps=2")
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.rmtree(source)
    done = train_cli(tmp_path / "tuned", digits_data_dir, *flags, "--config.num_train_steps=4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Resumed from step 2" in done.stderr


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_a_key_a_config_sets_can_be_set_back_to_none(tmp_path, digits_data_dir):
    config = tmp_path / "with_ema.py"
    config.write_text(
        "from replicator.trainer.config import config_beside\n"
        "def get_config(mode=''):\n"
        f"    c = config_beside({str(ROOT_CONFIG)!r}, 'digits_cnn.py', 'smoke')\n"
        "    c.ema_decay, c.grad_clip_norm = 0.9, 1.0\n"
        "    return c\n"
    )
    done = run_cli(
        "train", "--config", str(config), "--workdir", str(tmp_path / "run"), "--quiet",
        f"--config.data_dir={digits_data_dir}", "--config.num_train_steps=1",
        "--config.ema_decay=None", "--config.grad_clip_norm=None",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["ema_decay"] is None and saved["grad_clip_norm"] is None


@pytest.mark.slow  # 20 s: two LM compiles; tests/test_params.py holds the decayed set, fast
def test_a_scanned_lm_steps_with_weight_decay_as_the_unrolled_one_does():
    """AdamW's default mask on the trainer's path (the LM experiment's step, its
    optimizer wrapped by the Replicator): the scanned stack's LayerNorm scales and
    biases are not decayed, as the unrolled blocks' are not (decayed, they would
    differ by lr * wd = 5e-3)."""
    import flax.linen as nn

    from experiments.lm import make_experiment
    from experiments.lm.task import make_preprocess
    from replicator.parallel.sharding_rules import is_box
    from replicator.trainer.experiment import Settings

    shape = dict(vocab_size=32, num_layers=2, num_heads=2, embed_dim=16, mlp_dim=32, max_len=16)
    spec = OptimizerSpec(name="adamw", learning_rate=1e-2, weight_decay=0.5)
    repl = rp.Replicator(devices=jax.devices()[:1])
    batch = make_preprocess(16)({"tokens": np.random.default_rng(0).integers(0, 32, (4, 17))})
    example = jax.tree.map(lambda x: x[0], batch)
    initial, trained = None, []
    for scan in (False, True):
        experiment = make_experiment(Settings(
            repl=repl, model={**shape, "scan_layers": scan}, learning_rate=1e-2,
            optimizer="adamw", num_train_steps=2, grad_accum_steps=1, seed=0,
            optimizer_spec=spec,
        ))  # fmt: skip
        state = experiment.init_state(jax.random.key(0), example)
        if scan:  # the unrolled blocks' initial values, stacked (Adam's moments are zeros)
            state = state.replace(params=jax.tree.map(
                lambda box, v: box.replace_boxed(v) if is_box(box) else v,
                state.params, _stacked(initial, shape["num_layers"]), is_leaf=is_box,
            ))  # fmt: skip
        else:
            initial = jax.device_get(nn.meta.unbox(state.params))
        step = repl.compile(experiment.train_step)
        state, _ = step(repl.replicate(state), repl.shard_batch(batch))
        trained.append(jax.device_get(nn.meta.unbox(state.params)))
    unrolled, scanned = _stacked(trained[0], shape["num_layers"]), trained[1]
    assert_trained_alike(scanned, unrolled)  # after AdamW: a share of elements may round off
