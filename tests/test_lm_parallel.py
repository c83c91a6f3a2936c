"""The LM over the mesh axes ``context`` (sequence) and ``expert`` (mixture of experts).

The invariant: the LM trained with its attention split over ``context`` (gather or
ring, load balanced or not), or with mixture-of-experts blocks whose experts are
split over ``expert``, equals the same LM trained on one device, on both step paths.
"""

import jax
import numpy as np
import pytest

import replicator as rp
from experiments.lm import make_experiment
from experiments.lm.task import make_preprocess, summarize
from replicator.trainer import ConfigError
from replicator.trainer.experiment import Settings
from tests.compare import assert_trained_alike

TINY = dict(vocab_size=64, num_layers=4, num_heads=2, embed_dim=32, mlp_dim=64, max_len=32)
MOE = dict(TINY, num_experts=8, experts_per_token=2, expert_capacity_factor=1.0, moe_every=2)


def _settings(repl, model=TINY, **parallel):
    return Settings(
        repl=repl, model=model, learning_rate=3e-3, optimizer="adam", num_train_steps=3,
        grad_accum_steps=1, seed=0, options=parallel,
    )  # fmt: skip


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(0)
    preprocess = make_preprocess(TINY["max_len"])
    return [preprocess({"tokens": rng.integers(0, 64, (16, 33))}) for _ in range(3)]


def _train(repl, path, batches, model=TINY, **parallel):
    experiment = make_experiment(_settings(repl, model, **parallel))
    example = jax.tree.map(lambda x: x[0], batches[0])
    state = repl.init(experiment.init_state, jax.random.key(0), example)
    if path == "compile":
        step = repl.compile(experiment.train_step)
    else:
        step = lambda s, b: repl.run(experiment.train_step, s, b)  # noqa: E731
    records = []
    for batch in batches:
        state, sums = step(state, repl.shard_batch(batch))
        if sums["loss"].ndim:
            sums = repl.reduce(rp.ReduceOp.SUM, sums)
        records.append(summarize(jax.device_get(sums)))
    return records, jax.device_get(state.params)


def _assert_trains_alike(got, expected, rtol=1e-5, worst=1e-4):
    """The losses tight; the parameters after Adam steps as `tests.compare` bounds them."""
    np.testing.assert_allclose(
        [r["loss"] for r in got[0]], [r["loss"] for r in expected[0]], rtol=rtol
    )
    assert_trained_alike(got[1], expected[1], atol=2e-5, worst=worst)


@pytest.fixture(scope="module")
def one_device(batches):
    return _train(rp.Replicator(devices=jax.devices()[:1]), "compile", batches)


# ------------------------------------------------------------------ context


@pytest.mark.parametrize(
    "path, mesh, strategy, balanced",
    [
        ("compile", {"context": 2, "data": 4}, "ring", True),
        pytest.param("run", {"context": 4, "data": 2}, "gather", True, marks=pytest.mark.slow),
        pytest.param("compile", {"context": 2, "data": 4}, "gather", False, marks=pytest.mark.slow),
        pytest.param("compile", {"context": 4, "data": 2}, "gather", True, marks=pytest.mark.slow),
        pytest.param("compile", {"context": 4, "data": 2}, "ring", False, marks=pytest.mark.slow),
        pytest.param("compile", {"context": 4, "data": 2}, "ring", True, marks=pytest.mark.slow),
        pytest.param("run", {"context": 2, "data": 4}, "ring", False, marks=pytest.mark.slow),
        pytest.param("run", {"context": 2, "data": 4}, "gather", True, marks=pytest.mark.slow),
        pytest.param("run", {"context": 4, "data": 2}, "ring", True, marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_the_lm_over_context_trains_like_one_device(
    path, mesh, strategy, balanced, batches, one_device
):
    repl = rp.Replicator(mesh=mesh, min_size=0)
    got = _train(repl, path, batches, context_strategy=strategy, context_load_balance=balanced)
    _assert_trains_alike(got, one_device)


@pytest.mark.slow
def test_rotary_positions_follow_the_load_balanced_tokens(batches):
    model = dict(TINY, positions="rotary")
    one = _train(rp.Replicator(devices=jax.devices()[:1]), "compile", batches, model)
    repl = rp.Replicator(mesh={"context": 4, "data": 2}, min_size=0)
    got = _train(repl, "compile", batches, model, context_load_balance=True)
    _assert_trains_alike(got, one)


def test_a_length_that_does_not_balance_is_one_line(batches):
    repl = rp.Replicator(mesh={"context": 4, "data": 2}, min_size=0)
    short = [{k: v[:, :28] for k, v in b.items()} for b in batches[:1]]  # 28 % 8 != 0
    with pytest.raises(ValueError, match="does not split into 8 equal chunks") as error:
        _train(repl, "compile", short, context_load_balance=True)
    assert "\n" not in str(error.value)


def test_a_bad_context_strategy_is_one_config_error():
    from replicator.trainer.config import validate
    from tests.helpers.configs import load_config

    config = load_config("lm_tiny", "smoke")
    config.context_strategy = "spiral"
    with pytest.raises(ConfigError, match="context_strategy='spiral'") as error:
        validate(config)  # (the LM's key, checked by its Transformer: experiments.lm.config)
    (problem,) = str(error.value).splitlines()[1:]  # one problem, one line
    assert "use one of ('gather', 'ring')" in problem


def test_context_on_the_run_path_says_when_it_saves_no_memory(tmp_path, caplog):
    """Under ``step_path='run'`` a dense LM splits its sequences over ``context``; a
    mixture of experts keeps them whole, and training says so once, pointing to
    ``compile``, which says nothing."""
    from replicator.trainer.setup import setup
    from tests.helpers.configs import load_config
    from tests.test_lm import build

    data_dir = str(tmp_path / "tfds")
    build("python_stdlib/modules_128", data_dir)
    said = {}
    for path, experts in (("run", 4), ("compile", 4), ("run", 0)):
        config = load_config("lm_tiny", "smoke")
        config.update(mesh={"context": 2, "data": 4}, step_path=path, data_dir=data_dir)
        config.model.num_experts = experts
        caplog.clear()
        with caplog.at_level("WARNING", logger="replicator"):
            setup(config).close()
        messages = [r.getMessage() for r in caplog.records if "'context'" in r.getMessage()]
        said[path, experts] = messages
    assert len(said["run", 4]) == 1 and "step_path='compile'" in said["run", 4][0]
    assert said["compile", 4] == [] and said["run", 0] == []


# ------------------------------------------------------------------ experts


@pytest.fixture(scope="module")
def one_device_moe(batches):
    return _train(rp.Replicator(devices=jax.devices()[:1]), "compile", batches, MOE)


@pytest.mark.parametrize(
    "path, mesh",
    [
        pytest.param("compile", {"expert": 4, "data": 2}, marks=pytest.mark.slow),
        pytest.param("run", {"expert": 2, "data": 4}, marks=pytest.mark.slow),
        pytest.param("compile", {"expert": 2, "data": 4}, marks=pytest.mark.slow),
        pytest.param("compile", {"expert": 8}, marks=pytest.mark.slow),
        pytest.param("run", {"expert": 4, "data": 2}, marks=pytest.mark.slow),
        pytest.param("run", {"expert": 8}, marks=pytest.mark.slow),
    ],
)
def test_the_moe_lm_over_experts_trains_like_one_device(path, mesh, batches, one_device_moe):
    """The load-balancing and z losses included: under `run` too they are over the
    whole batch's tokens, as on one device."""
    expected = one_device_moe
    repl = rp.Replicator(mesh=mesh, min_size=0)
    got = _train(repl, path, batches, MOE)
    dropped = [r["dropped_fraction"] for r in got[0]]
    assert 0 < dropped[0] < 1  # capacity factor 1: some pairs dropped, the same ones
    np.testing.assert_allclose(dropped, [r["dropped_fraction"] for r in expected[0]], rtol=1e-6)
    # run sums the experts' outputs over "expert" in another order: in a few elements
    # Adam turns that into a step of up to the learning rate.
    _assert_trains_alike(got, expected, worst=1e-4 if path == "compile" else 1e-3)


_REDUCED_IN_THE_STEP = """
import jax, numpy as np
import tests.conftest  # 8 fake CPU devices
import replicator as rp
from experiments.lm import make_experiment
from experiments.lm.task import make_preprocess
from tests.test_lm_parallel import MOE, _settings

rng = np.random.default_rng(0)
batches = [make_preprocess(32)({"tokens": rng.integers(0, 64, (16, 33))}) for _ in range(3)]
repl = rp.Replicator(mesh={"expert": 2, "data": 4}, min_size=0)
experiment = make_experiment(_settings(repl, MOE))
example = jax.tree.map(lambda x: x[0], batches[0])
state = repl.init(experiment.init_state, jax.random.key(0), example)

def step(state, batch):
    state, sums = experiment.train_step(state, batch)
    return state, repl.reduce(rp.ReduceOp.SUM, sums)  # as the trainer's step does

for batch in batches:
    state, sums = repl.run(step, state, repl.shard_batch(batch))
    print("loss", float(jax.device_get(sums)["loss"]), flush=True)
"""


@pytest.mark.slow  # a subprocess: the XLA:CPU scheduler crash repro
def test_an_moe_step_reducing_its_sums_over_data_runs_on_cpu():
    """A step with collectives over two axes (the experts' over ``expert``, the sums'
    over ``data``) under `run`: XLA:CPU's memory-optimized scheduler, once a CPU
    default, crashed or deadlocked it at random (heap corruption, rendezvous
    timeouts). In a process of its own, so that a crash fails this test alone."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", _REDUCED_IN_THE_STEP], cwd=root, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    losses = [float(line.split()[1]) for line in done.stdout.splitlines()]
    assert len(losses) == 3 and all(np.isfinite(losses))


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False])
def test_a_capacity_of_every_expert_drops_nothing(scan_layers, batches):
    model = dict(MOE, expert_capacity_factor=8.0, scan_layers=scan_layers)
    repl = rp.Replicator(mesh={"expert": 4, "data": 2}, min_size=0)
    records, params = _train(repl, "compile", batches, model)
    assert [r["dropped_fraction"] for r in records] == [0.0, 0.0, 0.0]
    # moe_every=2: of each pair of blocks the first is dense, the second experts.
    blocks = params["blocks"] if scan_layers else params
    assert "mlp" in blocks["block_0"] and "moe" not in blocks["block_0"], blocks["block_0"].keys()
    assert "moe" in blocks["block_1"] and "mlp" not in blocks["block_1"], blocks["block_1"].keys()


def test_moe_keys_that_cannot_work_are_one_line():
    from experiments.lm.task import make_model

    for kwargs, message in [
        (dict(moe_every=3), "num_layers=4 must divide by it"),
        (dict(experts_per_token=9), r"experts_per_token=9 must be in \[1, num_experts=8\]"),
        (dict(expert_routing="top2"), "expert_routing='top2': use one of"),
    ]:
        with pytest.raises(ConfigError, match=message) as error:
            make_model({**MOE, **kwargs})
        assert "\n" not in str(error.value)
