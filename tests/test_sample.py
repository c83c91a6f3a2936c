"""Sampling the LM (`experiments.lm.sample`, ``python -m replicator sample``).

Invariants: a greedy continuation is the argmax of a full forward pass at every
position (GPT-2's block and Llama's, scanned and unrolled, prompts of different
lengths in one batch, on one device and sharded over data/fsdp/tensor); one
compile of the prefill and one of the decode step however many tokens; a seed
fixes the samples, and a sample does not depend on the rest of the batch; top-k
and top-p keep exactly the tokens their definitions keep.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from experiments.lm import kv_cache
from experiments.lm.model import Transformer
from experiments.lm.sample import (
    Sampler,
    SamplingOptions,
    cache_bytes_per_device,
    choose_tokens,
    filter_logits,
    generate,
    left_pad,
)
from replicator.errors import ConfigError

GPT2 = dict(vocab_size=64, num_layers=2, num_heads=4, embed_dim=32, mlp_dim=64, max_len=32)
LLAMA = dict(
    GPT2, positions="rotary", norm="rmsnorm", mlp_activation="swiglu", num_kv_heads=2,
    use_bias=False, tie_embeddings=False, rope_theta=500_000.0,
)  # fmt: skip
PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 60, 4], [11]]


def _model(kwargs, **more):
    model = Transformer(**{**kwargs, **more, "attention": "xla"})
    params = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"]
    # Wider weights than the initialisation's: logits far apart, so no near-ties.
    params = jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x, params)
    return model, params


def _assert_greedy_is_full_argmax(model, params, samples):
    """Each sample's tokens are the argmax of one full forward pass over its prompt and
    them (all samples in one batch, right-padded: the model is causal)."""
    sequences = [list(s.prompt_ids) + list(s.ids[:-1]) for s in samples]
    length = max(map(len, sequences))
    padded = np.asarray([x + [0] * (length - len(x)) for x in sequences], np.int32)
    argmax = np.argmax(np.asarray(jax.jit(model.apply)({"params": params}, padded)), axis=-1)
    for s, row in zip(samples, argmax):
        start = len(s.prompt_ids) - 1
        assert row[start : start + len(s.ids)].tolist() == list(s.ids)


# ----------------------------------------------------------------------- filtering


def _reference_filter(logits, top_k, top_p):
    """numpy: the top_k likeliest, then the fewest likeliest reaching top_p."""
    keep = np.ones_like(logits, bool)
    order = np.argsort(-logits, kind="stable")
    if top_k:
        keep[order[top_k:]] = False
    masked = np.where(keep, logits, -np.inf)
    probs = np.exp(masked - masked.max())
    probs /= probs.sum()
    total, nucleus = 0.0, np.zeros_like(keep)
    for i in order:
        if total >= top_p or not keep[i]:
            break
        nucleus[i] = True
        total += probs[i]
    return keep & nucleus if top_p < 1 else keep


@pytest.mark.parametrize("top_k,top_p", [(0, 0.5), (5, 1.0), (5, 0.9), (1, 1.0), (0, 0.05)])
def test_filter_logits_keeps_what_top_k_and_top_p_define(top_k, top_p):
    logits = np.asarray(jax.random.normal(jax.random.key(3), (6, 40)) * 2, np.float32)
    kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), top_k, top_p)))
    for row in range(len(logits)):
        assert kept[row].tolist() == _reference_filter(logits[row], top_k, top_p).tolist()
    assert kept.sum(-1).min() >= 1  # the likeliest token always stays


def test_filter_logits_off_changes_nothing_and_top_k_keeps_k():
    logits = jax.random.normal(jax.random.key(0), (2, 10))
    assert jnp.array_equal(filter_logits(logits), logits)
    assert np.isfinite(np.asarray(filter_logits(logits, top_k=3))).sum(-1).tolist() == [3, 3]


def test_choose_tokens_greedy_seeded_and_within_the_filter():
    logits = jax.random.normal(jax.random.key(0), (4, 50))
    keys = jax.random.split(jax.random.key(7), 4)
    greedy = choose_tokens(logits, keys, 3, temperature=0)
    assert greedy.tolist() == np.argmax(np.asarray(logits), -1).tolist()
    assert choose_tokens(logits, keys, 3, temperature=1.0, top_k=1).tolist() == greedy.tolist()
    draws = [choose_tokens(logits, keys, s, temperature=2.0, top_k=4) for s in range(30)]
    top4 = np.argsort(-np.asarray(logits), -1)[:, :4]
    assert all(int(d[r]) in top4[r] for d in draws for r in range(4))
    assert len({tuple(d.tolist()) for d in draws}) > 1  # steps draw anew
    again = choose_tokens(logits, keys, 5, temperature=2.0, top_k=4)
    assert again.tolist() == draws[5].tolist()
    padded = choose_tokens(logits, keys, 0, temperature=0, vocab_size=10)
    assert padded.tolist() == np.argmax(np.asarray(logits)[:, :10], -1).tolist()


def test_left_pad_and_options_check():
    tokens, start = left_pad([[1, 2], [3, 4, 5]], rows=4)
    assert tokens.tolist() == [[0, 1, 2], [3, 4, 5], [3, 4, 5], [3, 4, 5]]
    assert start.tolist() == [1, 0, 0, 0]
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(num_samples=0)):
        with pytest.raises(ConfigError):
            SamplingOptions(**bad)


# ----------------------------------------------------------------------- the model


@pytest.mark.parametrize(
    "kwargs,scan",
    [
        pytest.param(GPT2, True, marks=pytest.mark.slow),
        pytest.param(GPT2, False, marks=pytest.mark.slow),
        (LLAMA, True),
        pytest.param(LLAMA, False, marks=pytest.mark.slow),
    ],
    ids=["gpt2-scan", "gpt2-unrolled", "llama-scan", "llama-unrolled"],
)
def test_greedy_is_the_full_forward_argmax_at_every_position(kwargs, scan):
    model, params = _model(kwargs, scan_layers=scan)
    samples = generate(model, params, PROMPTS, max_new_tokens=10, temperature=0)
    assert [s.prompt_ids for s in samples] == [tuple(p) for p in PROMPTS]
    assert all(len(s.ids) == 10 and s.finish_reason == "length" for s in samples)
    _assert_greedy_is_full_argmax(model, params, samples)


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_the_cached_forward_equals_the_full_forward():
    model, params = _model(LLAMA)
    apply = jax.jit(model.apply)
    tokens = jnp.asarray([[3, 4, 5, 6, 7, 8]])
    full = apply({"params": params}, tokens)
    cache = kv_cache.init_cache(model, jnp.zeros(1, jnp.int32), 6)
    first, cache = apply({"params": params}, tokens[:, :4], cache=cache)
    rest = []
    for t in (4, 5):
        logits, cache = apply({"params": params}, tokens[:, t : t + 1], cache=cache)
        rest.append(logits)
    cached = jnp.concatenate([first, *rest], axis=1)
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)
    assert cache.k.shape == (2, 1, 6, 2, 8)  # [layers, batch, slots, kv heads, head_dim]
    assert int(cache.index) == 6


def test_one_compile_of_prefill_and_of_decode_however_many_tokens():
    model, params = _model(GPT2)
    sampler = Sampler(model)
    options = SamplingOptions(max_new_tokens=20, temperature=0.8, top_k=10, seed=0)
    first = sampler.generate(params, PROMPTS, options)
    assert all(len(s.ids) == 20 for s in first)
    again = sampler.generate(params, PROMPTS, SamplingOptions(**{**vars(options), "seed": 1}))
    assert dict(sampler.traces) == {"prefill": 1, "decode": 1}
    assert [s.ids for s in first] != [s.ids for s in again]


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_a_seed_fixes_the_samples_and_a_sample_ignores_the_rest_of_the_batch():
    model, params = _model(LLAMA)
    sampler = Sampler(model)
    options = SamplingOptions(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=4, num_samples=2)
    batch = sampler.generate(params, PROMPTS, options)
    assert [s.ids for s in batch] == [s.ids for s in sampler.generate(params, PROMPTS, options)]
    assert [(s.prompt_index, s.sample_index) for s in batch[:3]] == [(0, 0), (0, 1), (1, 0)]
    assert batch[0].ids != batch[1].ids  # two samples of one prompt differ
    # Alone (one row of 3 tokens, no padding; in the batch: 4 padding slots before it),
    # prompt 0 samples the same: a row's key is its prompt's and sample's.
    alone = sampler.generate(params, PROMPTS[:1], options)
    assert [s.ids for s in alone] == [s.ids for s in batch[:2]]


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_stop_tokens_end_a_sample():
    model, params = _model(GPT2)
    greedy = generate(model, params, PROMPTS, max_new_tokens=6, temperature=0)
    stop = greedy[0].ids[2]
    stopped = generate(model, params, PROMPTS, max_new_tokens=6, temperature=0, stop_ids=(stop,))
    first = stopped[0]
    assert (
        first.finish_reason == "stop"
        and first.ids == greedy[0].ids[: greedy[0].ids.index(stop) + 1]
    )
    for s, g in zip(stopped, greedy):
        assert g.ids[: len(s.ids)] == s.ids  # stopping changes no token before it


def test_prompts_that_cannot_be_continued_are_one_line_errors():
    model, params = _model(GPT2)
    sampler = Sampler(model)
    options = SamplingOptions(max_new_tokens=4)
    for prompts, text in (
        ([], "no prompt"), ([[]], "empty prompt"), ([[1, 64]], "outside the vocabulary"),
        ([[1] * 32], "max_len 32"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=text):
            sampler.check(prompts, options)
    # A continuation past max_len is cut to fit, not refused.
    (s,) = generate(model, params, [[1] * 30], max_new_tokens=8, temperature=0)
    assert len(s.ids) == 3


# ----------------------------------------------------------------------- sharded


def test_sharded_over_data_fsdp_tensor_samples_as_one_device():
    model, params = _model(LLAMA)
    one = generate(model, params, PROMPTS, max_new_tokens=8, temperature=0)
    repl = rp.Replicator(mesh={"data": 2, "fsdp": 2, "tensor": 2}, min_size=0)
    boxed = jax.eval_shape(model.init, jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"]
    shardings = repl.param_shardings(boxed)
    placed = jax.device_put(params, jax.tree.map(lambda s: s, shardings))
    sampler = Sampler(model, repl=repl)
    sharded = sampler.generate(placed, PROMPTS, SamplingOptions(max_new_tokens=8, temperature=0))
    assert [s.ids for s in sharded] == [s.ids for s in one]
    kv = sampler.state_shardings().cache.k
    assert kv.spec[1] == ("data", "fsdp") and kv.spec[3] == "tensor"
    # 4 rows over 4 replicas, 2 kv heads over 2 tensor devices: an eighth on each.
    whole = kv_cache.cache_bytes(model, 4, 16)
    assert cache_bytes_per_device(model, repl, 4, 16, jnp.float32) == whole // 8


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_bf16_policy_caches_in_bf16():
    model, params = _model(GPT2)
    repl = rp.Replicator(devices=jax.devices()[:1], precision="bf16")
    sampler = Sampler(repl.apply_policy(model), repl=repl)
    assert sampler._cache_dtype() == jnp.bfloat16
    samples = sampler.generate(params, PROMPTS, SamplingOptions(max_new_tokens=4, temperature=0))
    assert all(len(s.ids) == 4 for s in samples)


# ----------------------------------------------------------------------- the command


# The trainer's glue: a trained run (tens of seconds on 2 loaded cores), so `slow`.


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """lm_tiny's smoke mode trained 2 steps (rotary positions, 2 layers) in-process."""
    from replicator.trainer import train_and_evaluate
    from tests.helpers.configs import CONFIG_DIR, load_config

    config = load_config(CONFIG_DIR / "lm_tiny.py", "smoke")
    workdir = str(tmp_path_factory.mktemp("sample") / "run")
    with config.unlocked():
        config.data_dir = str(tmp_path_factory.mktemp("tfds"))
        config.model.update(num_layers=2, positions="rotary")
        config.update(num_train_steps=2, eval_every_steps=1000, checkpoint_every_steps=2)
    train_and_evaluate(config, workdir, quiet=True)
    return config, workdir


@pytest.mark.slow
def test_sample_restores_the_checkpoint_and_continues_greedily(lm_run):
    from experiments.lm.task import make_model
    from replicator.trainer import sample_command
    from replicator.trainer.setup import setup

    config, workdir = lm_run
    records = sample_command.sample(
        None, workdir, prompts=["def f(x):", "import"], max_new_tokens=6, temperature=0,
        stop_ids=(),
    )  # fmt: skip
    assert [r["prompt_ids"] for r in records] == [list(b"def f(x):"), list(b"import")]
    assert all(r["step"] == config.num_train_steps and len(r["ids"]) == 6 for r in records)
    assert records[0]["text"] == bytes(records[0]["ids"]).decode("utf-8", "replace")
    # The checkpoint's parameters, in a full forward pass, agree at every new position.
    run = setup(config, training=False)
    params, step = sample_command._restore_params(run, workdir, None, False)
    run.close()
    assert step == config.num_train_steps
    model = make_model(config.model.to_dict())
    for r in records:
        sequence = r["prompt_ids"] + r["ids"]
        logits = model.apply({"params": params}, jnp.asarray([sequence[:-1]]))
        argmax = np.argmax(np.asarray(logits[0]), axis=-1)
        assert argmax[len(r["prompt_ids"]) - 1 :].tolist() == r["ids"]


@pytest.mark.slow
def test_sample_without_checkpoint_or_init_from_is_one_line(tmp_path, lm_run):
    from replicator.trainer import sample_command

    config, _ = lm_run
    with pytest.raises(ConfigError, match="holds no checkpoint and config.init_from is None"):
        sample_command.sample(config, str(tmp_path / "empty"), prompt_ids=[[1, 2]])


@pytest.mark.slow
def test_the_command_prints_one_json_line_per_sample_and_bad_inputs_exit_2(lm_run, tmp_path):
    from tests.helpers.cli import assert_one_line_error, run_cli

    config, workdir = lm_run
    done = run_cli(
        "sample", "--workdir", workdir, "--prompt_ids", "100,101", "--prompt", "x",
    )  # fmt: skip
    assert_one_line_error(done, "one kind")
    done = run_cli(
        "sample", "--workdir", workdir, "--prompt_ids", "100,101,102", "--prompt_ids", "5",
        "--max_new_tokens", "5", "--temperature", "0.7", "--top_k", "20", "--seed", "3",
        "--num_samples", "2", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in records] == [
        (0, 0), (0, 1), (1, 0), (1, 1),
    ]  # fmt: skip
    assert all(r["prompt_ids"] in ([100, 101, 102], [5]) and "text" in r for r in records)
    assert all(1 <= len(r["ids"]) <= 5 for r in records)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,expected",
    [
        (["--prompt_ids", "1,2", "--temperature", "-1"], "temperature=-1.0"),
        (["--prompt_ids", ",".join(["1"] * 200)], "max_len 128"),
        (["--prompt_ids", "1,x"], "--prompt_ids='1,x'"),
        ([], "one kind"),
    ],
)
def test_more_bad_inputs_are_one_line(lm_run, args, expected):
    from tests.helpers.cli import run_cli

    _, workdir = lm_run
    done = run_cli("sample", "--workdir", workdir, *args)
    assert done.returncode == 2, done.stderr[-3000:]
    # One line, after (at most) the one that says which config it read.
    *before, line = [x for x in done.stderr.splitlines() if x.strip()]
    assert line.startswith("error: ") and expected in line, done.stderr
    assert [x.split(":")[0] for x in before] in ([], ["sample"]), done.stderr


def test_prompts_of_both_kinds_or_neither_are_refused_before_anything_is_read(tmp_path):
    from replicator.errors import UsageError
    from replicator.trainer import sample_command

    for kinds in (dict(prompts=["a"], prompt_ids=[[1]]), {}):
        with pytest.raises(UsageError, match="one kind"):
            sample_command.sample(None, str(tmp_path / "none"), **kinds)
    with pytest.raises(UsageError, match="separated by commas"):
        sample_command.parse_ids("1,x", "--prompt_ids")


# ----------------------------------------------------------------------- Hugging Face


def _hf_greedy(hf_model, prompt, new):
    """Greedy continuation by HF's own forward pass (transformers, torch), token by token."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(  # GPT-2's import equals HF's forward in tests/test_hf.py, fast
    "family", [pytest.param("gpt2", marks=pytest.mark.slow), "llama_gqa_llama3_untied",
               "qwen2_bias"]
)  # fmt: skip
def test_greedy_samples_of_an_imported_checkpoint_are_hf_greedy(family, tmp_path):
    pytest.importorskip("torch")
    from tests import test_hf

    hf_model = test_hf.FAMILIES[family]()
    net, variables, _ = test_hf.import_params(test_hf.save(hf_model, str(tmp_path)))
    samples = generate(net, variables["params"], PROMPTS, max_new_tokens=8, temperature=0)
    assert [list(s.ids) for s in samples] == [_hf_greedy(hf_model, p, 8) for p in PROMPTS]


@pytest.mark.slow
def test_sample_with_init_from_hf_and_no_checkpoint_samples_the_import(tmp_path):
    pytest.importorskip("torch")
    from replicator.trainer import sample_command
    from tests import test_hf

    hf_model = test_hf.llama()
    config = test_hf.lm_config(test_hf.save(hf_model, str(tmp_path / "hf")))
    with config.unlocked():
        config.data_dir = str(tmp_path / "tfds")
    records = sample_command.sample(
        config, str(tmp_path / "run"), prompt_ids=PROMPTS, max_new_tokens=6, temperature=0,
        stop_ids=(),
    )  # fmt: skip
    assert all(r["step"] is None for r in records)
    assert [r["ids"] for r in records] == [_hf_greedy(hf_model, p, 6) for p in PROMPTS]
    assert not os.path.exists(tmp_path / "run")  # sampling writes nothing


def test_text_in_and_out_with_the_byte_tokenizer():
    from experiments.datasets.tokenizers import load_tokenizer
    from experiments.lm.sample import TextSampler

    text = TextSampler(Sampler(Transformer(**GPT2)), load_tokenizer("bytes"))
    assert text.encode("hé") == [104, 195, 169] and text.eos_id == 0  # no BOS for bytes
    assert text.decode([104, 195, 169]) == "hé"
    assert text.decode([104, 300, 105, 195]) == "h\ufffdi\ufffd"  # beyond the bytes; cut UTF-8
    assert TextSampler(text.sampler, None).decode([1, 2]) is None


@pytest.mark.slow  # a tfds build and three programs compiled by libtpu
def test_compile_reports_the_decode_step_and_its_kv_cache_per_chip(tmp_path):
    pytest.importorskip("libtpu")
    from replicator.trainer import aot
    from tests.test_tpu_compile import compile_lm

    report = compile_lm("v5e-16", stdlib_dir=str(tmp_path), batch_size=32)
    decode = report.to_json()["decode_step"]
    # lm_tiny smoke: 1 layer, 2 heads of 16, 128 slots; 32 rows over 16 fsdp chips, float32.
    assert (decode["batch"], decode["slots"]) == (32, 128)
    assert decode["kv_cache_bytes_per_chip"] == 2 * 1 * 2 * 128 * 2 * 16 * 4
    assert decode["fits"] and decode["total_bytes"] >= decode["kv_cache_bytes_per_chip"]
    assert any(line.startswith("decode step (32 rows, 128 cache slots)")
               for line in aot.summary_lines(report))  # fmt: skip
