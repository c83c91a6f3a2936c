"""The language-model experiment: its offline text data, its transformer, its steps.

Invariants rather than recorded outputs: windows are the corpus' own bytes, cut
exactly as documented; logits never see the future; every parameter names its
logical axes; 8 replicas (on a 2-D mesh) train exactly like the global view,
microbatches like the whole batch; padding adds nothing to eval sums.
"""

import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

import replicator as rp
from experiments.datasets import text
from experiments.datasets.base import LocalBuilder
from experiments.lm import Transformer, count_params, make_experiment, make_preprocess, summarize
from replicator.parallel import activations as activations
from replicator.parallel import sharding as sharding
from replicator.trainer import ConfigError
from replicator.trainer.experiment import Settings
from tests.compare import assert_trained_alike
from tests.helpers.configs import config_module, load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = 128
TINY = dict(vocab_size=256, num_layers=1, num_heads=2, embed_dim=32, mlp_dim=64, max_len=BLOCK)
LOGICAL_NAMES = {"embed", "mlp", "heads", "kv", "vocab"}


def build(name: str, data_dir: str) -> dict:
    builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare(file_format="array_record")
    return {split: builder.as_data_source(split=split) for split in ("train", "test")}


def tokens_of(source, indices) -> np.ndarray:
    return np.stack([source[int(i)]["tokens"] for i in indices])


def settings(repl: rp.Replicator, **overrides) -> Settings:
    values = dict(
        repl=repl,
        model=TINY,
        learning_rate=3e-3,
        optimizer="adam",
        num_train_steps=20,
        grad_accum_steps=1,
        seed=0,
    )
    return Settings(**{**values, **overrides})


@pytest.fixture(scope="module")
def stdlib(tmp_path_factory) -> dict:
    return build("python_stdlib/modules_128", str(tmp_path_factory.mktemp("tfds")))


@pytest.fixture(scope="module")
def batches(stdlib) -> list[dict]:
    """Preprocessed training batches of 24 real windows (3 per replica)."""
    rng = np.random.default_rng(0)
    preprocess = make_preprocess(BLOCK)
    train = stdlib["train"]
    return [
        preprocess({"tokens": tokens_of(train, rng.integers(0, len(train), 24))}) for _ in range(20)
    ]


# ----------------------------------------------------------------------- data


def test_windows_are_the_stdlib_sources_bytes(stdlib):
    documents = text.stdlib_documents("modules")
    corpus = b"\0".join(d.path.read_bytes() for d in documents)
    train, test = stdlib["train"], stdlib["test"]
    for window in tokens_of(train, np.linspace(0, len(train) - 1, 20).astype(int)):
        assert window.dtype == np.int32 and window.shape == (BLOCK + 1,)
        assert window.min() >= 0 and window.max() < text.BYTE_VOCAB_SIZE
        assert bytes(window.astype(np.uint8)).strip(b"\0") in corpus  # real text, in order
    # The test split is exactly the windows of the held-out files, cut as documented.
    splits = text.split_documents(documents)
    expected = sorted(w.tobytes() for w in text.cut_windows(splits["test"], BLOCK))
    assert sorted(w.tobytes() for w in tokens_of(test, range(len(test)))) == expected
    held_out = [d.name for d in documents if text.is_test_document(d.name)]
    assert 0 < len(held_out) < 0.15 * len(documents)
    train_tokens = sum(len(t) for t in splits["train"])
    assert len(train) == (train_tokens - 1) // BLOCK


def test_text_files_reads_your_own_text_and_token_files(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "more").mkdir(parents=True)
    names = [f"doc{i}.txt" for i in range(30)]
    for i, name in enumerate(names):
        (corpus / name).write_text(f"document {i}: " + "lorem ipsum dolor " * (i + 1))
    np.save(corpus / "more" / "ids.npy", np.arange(1000, 1100, dtype=np.int64))
    data_dir = str(tmp_path / "tfds")
    name = f"text_files/block_size=16,files={corpus}/**/*"
    sources = build(name, data_dir)

    documents = text.file_documents(f"{corpus}/**/*")
    assert len(documents) == 31 and documents[-1].name == "more/ids.npy"
    splits = text.split_documents(documents)
    for split, source in sources.items():
        expected = sorted(w.tobytes() for w in text.cut_windows(splits[split], 16))
        assert sorted(source[i]["tokens"].tobytes() for i in range(len(source))) == expected
    all_tokens = np.concatenate([tokens_of(s, range(len(s))).ravel() for s in sources.values()])
    assert {1000, 1050} <= set(all_tokens.tolist())  # the .npy file's ids, unchanged
    # Adding a file makes a new copy under a new name instead of reading a stale one.
    before = tfds.builder(name, data_dir=data_dir).builder_config.name
    (corpus / "late.txt").write_text("added later")
    assert tfds.builder(name, data_dir=data_dir).builder_config.name != before


class TinyTextCorpus(LocalBuilder):
    """A text dataset as tfds ships them (lm1b, wiki40b: a string feature per example)."""

    VERSION = tfds.core.Version("1.0.0")
    TEXTS = {"train": ["héllo world", "a second line", "x" * 20], "validation": ["held out"]}

    def _info(self):
        features = tfds.features.FeaturesDict({"text": tfds.features.Text()})
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(texts) for split, texts in self.TEXTS.items()}

    def _generate_examples(self, texts):
        for i, line in enumerate(texts):
            yield i, {"text": line}


def test_text_tfds_windows_a_tfds_text_dataset(tmp_path):
    data_dir = str(tmp_path / "tfds")
    tfds.builder("tiny_text_corpus", data_dir=data_dir).download_and_prepare(
        file_format="array_record"
    )
    sources = build("text_tfds/source=tiny_text_corpus,block_size=4,test_split=validation",
                    data_dir)  # fmt: skip
    for split, key in (("train", "train"), ("test", "validation")):
        source = tfds.data_source("tiny_text_corpus", split=key, data_dir=data_dir)
        documents = [  # in the source's order, each followed by the byte 0
            np.frombuffer(source[i]["text"] + b"\0", np.uint8).astype(np.int32)
            for i in range(len(source))
        ]
        expected = [w.tolist() for w in text.cut_windows(documents, 4)]
        got = sources[split]
        assert sorted(got[i]["tokens"].tolist() for i in range(len(got))) == sorted(expected)
    assert len(sources["train"]) == (len("héllo world".encode()) + 13 + 20 + 3 - 1) // 4


def test_one_big_file_holds_out_its_tail(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(bytes(range(32, 127)) * 10)
    documents = text.file_documents(str(path))
    splits = {k: list(v) for k, v in text.split_documents(documents).items()}
    whole = text.read_tokens(documents[0])
    assert np.array_equal(np.concatenate(splits["train"] + splits["test"]), whole)
    assert len(splits["test"][0]) == round(len(whole) * text.TEST_FRACTION)


# ---------------------------------------------------------------------- model


@pytest.mark.parametrize(  # the mask is the same for both: rotary stays in make test
    "positions", [pytest.param("learned", marks=pytest.mark.slow), "rotary"]
)
def test_logits_never_see_the_future(positions):
    model = Transformer(**{**TINY, "max_len": 16}, positions=positions, tie_embeddings=False)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
    params = jax.jit(model.init)(jax.random.key(0), tokens)
    both = jax.jit(model.apply)(params, jnp.concatenate([tokens, changed]))
    logits, logits_changed = jnp.split(both, 2)
    assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
    np.testing.assert_array_equal(logits[:, :10], logits_changed[:, :10])
    assert not np.allclose(logits[:, 10:], logits_changed[:, 10:])


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_every_parameter_names_its_logical_axes(tie_embeddings):
    model = Transformer(**TINY, tie_embeddings=tie_embeddings, scan_layers=False)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    boxed = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert boxed and all(isinstance(x, nn.LogicallyPartitioned) for x in boxed)
    used = set()
    for leaf in boxed:
        assert len(leaf.names) == leaf.value.ndim
        assert set(leaf.names) <= LOGICAL_NAMES | {None}
        used |= set(leaf.names) - {None}
    assert used == LOGICAL_NAMES
    specs = nn.get_partition_spec(params)["params"]
    assert specs["token_embedding"]["embedding"] == jax.sharding.PartitionSpec("vocab", "embed")
    attention = specs["block_0"]["attention"]
    assert attention["out_kernel"] == jax.sharding.PartitionSpec("heads", "kv", "embed")
    assert specs["block_0"]["mlp"]["fc"]["kernel"] == jax.sharding.PartitionSpec("embed", "mlp")
    # Scanned (the default): the same names behind the stack's own axis, "layers".
    stacked = Transformer(**TINY, tie_embeddings=tie_embeddings)
    stacked = jax.eval_shape(stacked.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    stacked = nn.get_partition_spec(stacked)["params"]["blocks"]
    assert stacked["attention"]["out_kernel"] == jax.sharding.PartitionSpec(
        "layers", "heads", "kv", "embed"
    )


@pytest.mark.parametrize("tie_embeddings", [pytest.param(True, marks=pytest.mark.slow), False])
def test_a_chunked_loss_equals_the_whole_one_without_whole_logits(tie_embeddings):
    """``loss_chunk``: the same nats and gradients as the logits made whole, while the
    compiled step's temporaries drop (the ``[batch, time, vocab]`` float32 logits
    of a 4,096-token vocabulary never exist at once)."""
    config = {**TINY, "vocab_size": 4096, "max_len": 64, "tie_embeddings": tie_embeddings}
    tokens = jax.random.randint(jax.random.key(1), (4, 64), 0, 4096)
    targets = jnp.roll(tokens, -1, axis=1)
    whole, chunked = Transformer(**config), Transformer(**config, loss_chunk=16)
    params = whole.init(jax.random.key(0), tokens)
    assert jax.tree.structure(params) == jax.tree.structure(chunked.init(jax.random.key(0), tokens))

    def loss(model):
        return lambda p: jnp.mean(model.apply(p, tokens, targets=targets))

    steps = {m: jax.jit(jax.value_and_grad(loss(m))) for m in (whole, chunked)}
    (want, want_grads), (got, got_grads) = (steps[m](params) for m in (whole, chunked))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), got_grads, want_grads)
    nats = whole.apply(params, tokens, targets=targets)
    logits = whole.apply(params, tokens)
    np.testing.assert_allclose(nats, optax_nats(logits, targets), rtol=1e-6)
    temp = {
        m: steps[m].lower(params).compile().memory_analysis().temp_size_in_bytes
        for m in (whole, chunked)
    }
    logits_bytes = 4 * 64 * 4096 * 4
    assert temp[chunked] < temp[whole] - logits_bytes


def optax_nats(logits, targets):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def test_too_long_a_sequence_is_a_one_line_error():
    # The trainer's input: a config mistake (the CLI prints it in one line, exit 2).
    with pytest.raises(ConfigError, match="windows hold 129 tokens, above config.model.max_len"):
        make_preprocess(128)({"tokens": np.zeros((2, 130), np.int32)})
    model = Transformer(**TINY)
    with pytest.raises(ValueError, match="Sequence length 129 is above the model's max_len 128."):
        jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 129), jnp.int32))
    with pytest.raises(ConfigError, match="'num_layer'"):
        make_experiment(settings(rp.Replicator(), model={**TINY, "num_layer": 2}))
    with pytest.raises(ConfigError, match="does not divide into num_heads=3"):
        make_experiment(settings(rp.Replicator(), model={**TINY, "num_heads": 3}))


# ----------------------------------------------------------------- experiment


def _train(repl, step_fn, state, batches):
    losses = []
    for batch in batches:
        state, sums = step_fn(state, repl.shard_batch(batch))
        if sums["loss"].ndim:  # per-replica sums from run
            sums = repl.reduce(rp.ReduceOp.SUM, sums)
        losses.append(summarize(jax.device_get(sums))["loss"])
    return state, losses


@pytest.fixture(scope="module")
def mesh_2d() -> rp.Replicator:
    return rp.Replicator(mesh={"data": 4, "fsdp": 2})


@pytest.fixture(scope="module")
def trained(mesh_2d, batches) -> dict:
    """20 steps under `run` on a 2-D mesh (8 replicas) from one initial state."""
    experiment = make_experiment(settings(mesh_2d))
    initial = jax.jit(experiment.init_state)(
        jax.random.key(0), jax.tree.map(lambda x: x[0], batches[0])
    )
    run = lambda s, b: mesh_2d.run(experiment.train_step, s, b)
    state, params, losses = mesh_2d.replicate(initial), [], []
    for batch in batches:
        state, (loss,) = _train(mesh_2d, run, state, [batch])
        params.append(jax.device_get(state.params))
        losses.append(loss)
    return dict(experiment=experiment, initial=initial, state=state, params=params, losses=losses)


def test_run_on_a_2d_mesh_equals_compile_and_the_loss_falls(mesh_2d, batches, trained):
    experiment = trained["experiment"]
    assert experiment.metric_names == ("loss", "perplexity", "bits_per_byte")
    assert experiment.units == ("tokens", BLOCK)
    compiled = mesh_2d.compile(experiment.train_step)
    state, losses = _train(mesh_2d, compiled, mesh_2d.replicate(trained["initial"]), batches[:3])

    np.testing.assert_allclose(trained["losses"][:3], losses, rtol=1e-5)
    # compile places the activations by the rules (the batch over data and fsdp): other
    # reduction orders, which Adam's first steps magnify in near-zero parameters.
    assert_trained_alike(trained["params"][2], jax.device_get(state.params))
    losses = trained["losses"]
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)
    assert np.mean(losses[-3:]) < losses[0] - 1.5, losses


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_activations_named_by_the_model_follow_maxtexts_rules_under_compile(batches, trained):
    """The rules table places the model's activations too (MaxText's logical axes), by
    default: on the 2x2x2 cube with the batch over data and fsdp, compile trains like
    `run`; rules naming the activation axes replace the defaults."""
    cube = rp.Replicator(mesh={"data": 2, "fsdp": 2, "tensor": 2})
    experiment = make_experiment(settings(cube))
    compiled = cube.compile(experiment.train_step)
    state = cube.replicate(trained["initial"])
    unplaced = tuple((name, None) for name, _ in activations.ACTIVATION_RULES)
    plain = rp.Replicator(  # activations left to the compiler
        mesh={"data": 2, "fsdp": 2, "tensor": 2}, rules=(*sharding.DEFAULT_RULES, *unplaced)
    )
    constraints = [
        repl.compile(make_experiment(settings(repl)).train_step)
        .lower(state, repl.shard_batch(batches[0]))
        .as_text()
        .count("sharding_constraint")
        for repl in (cube, plain)
    ]
    assert constraints[0] >= constraints[1] + 4, constraints  # q, k, v, the MLP, residuals
    state, losses = _train(cube, compiled, state, batches[:3])
    np.testing.assert_allclose(trained["losses"][:3], losses, rtol=1e-5)
    # Other reduction orders: Adam's first steps magnify them in near-zero parameters
    # (the rare token rows of the embedding: 1.6e-5 of an update of 3e-3).
    assert_trained_alike(trained["params"][2], jax.device_get(state.params))


def test_microbatches_train_like_the_whole_batch(mesh_2d, batches, trained):
    experiment = make_experiment(settings(mesh_2d, grad_accum_steps=3))  # 1 example each
    run = lambda s, b: mesh_2d.run(experiment.train_step, s, b)
    state, losses = _train(mesh_2d, run, mesh_2d.replicate(trained["initial"]), batches[:2])
    np.testing.assert_allclose(trained["losses"][:2], losses, rtol=1e-5)
    assert_trained_alike(trained["params"][1], jax.device_get(state.params))


def test_eval_sums_weigh_real_tokens_only(stdlib, mesh_2d, trained):
    experiment = trained["experiment"]
    eval_state = experiment.eval_state(trained["state"])
    test = stdlib["test"]
    real = make_preprocess(BLOCK)({"tokens": tokens_of(test, range(5))})

    # 5 real windows padded to 8 rows (one per replica) with other windows, masked out.
    padding = make_preprocess(BLOCK)({"tokens": tokens_of(test, range(100, 103))})
    padded = jax.tree.map(lambda a, b: np.concatenate([a, b]), real, padding)
    padded["mask"] = np.arange(8) < 5
    sums = mesh_2d.reduce(
        rp.ReduceOp.SUM, mesh_2d.run(experiment.eval_step, eval_state, mesh_2d.shard_batch(padded))
    )
    alone = jax.jit(experiment.eval_step)(eval_state, {**real, "mask": np.ones(5, bool)})

    assert float(sums["tokens"]) == float(alone["tokens"]) == 5 * BLOCK
    padded_metrics, real_metrics = summarize(jax.device_get(sums)), summarize(alone)
    assert padded_metrics["loss"] == pytest.approx(real_metrics["loss"], rel=1e-6)
    assert padded_metrics["perplexity"] == pytest.approx(math.exp(padded_metrics["loss"]))


def test_bf16_policy_computes_in_bf16_from_f32_parameters(batches):
    repl = rp.Replicator(precision="bf16")
    experiment = make_experiment(settings(repl))
    batch = jax.tree.map(lambda x: x[:4], batches[0])
    state = jax.eval_shape(
        experiment.init_state, jax.random.key(0), jax.tree.map(lambda x: x[0], batch)
    )
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    jaxpr = str(jax.make_jaxpr(experiment.train_step)(state, batch))
    assert "dot_general" in jaxpr and "bf16" in jaxpr


# -------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "name, low, high",
    [
        ("lm_tiny", 3e5, 6e5),
        ("lm_gpt2_124m", 80e6, 90e6),
        ("lm_1b", 0.95e9, 1.1e9),
        ("lm_8b", 7.6e9, 8.0e9),
    ],
)
def test_configs_name_real_models_and_smoke_modes(name, low, high):
    module, config = config_module(name), load_config(name, "")
    assert f"python -m replicator train --config configs/{name}.py" in module.__doc__
    assert "Expected:" in module.__doc__
    model = config.model.to_dict()
    tokens = jnp.zeros((1, model["max_len"]), jnp.int32)
    params = jax.eval_shape(Transformer(**model).init, jax.random.key(0), tokens)
    assert low < count_params(params) < high
    assert config.dataset.endswith(f"_{model['max_len']}")
    smoke = load_config(name, "smoke")
    assert smoke.num_train_steps <= 10 and smoke.batch_size <= 64
    assert smoke.dataset == "python_stdlib/modules_128"
    make_experiment(settings(rp.Replicator(mesh=dict(smoke.mesh)), model=smoke.model.to_dict()))
