"""Hugging Face checkpoints in and out of the LM, checked against transformers' own code.

Random tiny checkpoints of each family (every weight drawn at random, biases and norms
too, so a mapping that drops or swaps one shows) are saved with ``save_pretrained`` and
imported (``init_from='hf:DIR'``); the LM's logits must equal HF's torch forward in
float32. A run trained from an imported Llama is exported (``export --format hf``) and
HF's ``from_pretrained`` must give the logits of the trained weights.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from replicator.errors import ConfigError
from replicator.parallel import sharding as sharding
from replicator.trainer import init_from, pretrained
from replicator.trainer.evaluator import run_config
from replicator.trainer.safetensors_files import INDEX, SafetensorsDir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB = 300  # above the bytes' 256: the python_stdlib windows fit
LLAMA3_SCALING = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=8,
)  # fmt: skip


def gpt2(**kw):
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=128, **kw
    )
    return transformers.GPT2LMHeadModel(config)


def llama(tied=False, **kw):
    config = transformers.LlamaConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500_000.0,
        "rope_scaling": LLAMA3_SCALING, "max_position_embeddings": 128,
        "tie_word_embeddings": tied, "rms_norm_eps": 1e-5, **kw,
    })  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def mistral():
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, sliding_window=128,
    )  # fmt: skip
    return transformers.MistralForCausalLM(config)


def qwen2():
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


FAMILIES = {
    "gpt2": gpt2,
    "llama_gqa_llama3_untied": llama,
    "llama_mha_tied": lambda: llama(tied=True, num_key_value_heads=4, head_dim=8),
    "mistral": mistral,
    "qwen2_bias": qwen2,
}


def save(model, directory, **kwargs) -> str:
    """``model`` with every weight random, saved as HF saves it; returns ``hf:DIR``."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.eval().save_pretrained(directory, safe_serialization=True, **kwargs)
    return f"hf:{directory}"


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids))).logits.numpy()


def import_params(spec, repl=None, **model_keys):
    """The LM and its parameters as ``init_from`` loads them (`pretrained.plan`, `read`,
    `init_from.place`), in ``repl``'s shardings (default: one device)."""
    from experiments.lm.task import make_model

    _, hf_config = pretrained.read_hf_config(spec)
    keys = {"max_len": 64, "attention": "xla", **model_keys}
    model = pretrained.layout("experiments.lm", keys, hf_config).model
    net = make_model(model)
    repl = repl or rp.Replicator(devices=jax.devices()[:1])
    tokens = jnp.zeros((1, 8), jnp.int32)
    abstract = jax.eval_shape(lambda: net.init(jax.random.key(0), tokens))
    abstract = sharding.attach_shardings(abstract, repl.param_shardings(abstract))
    the_plan, source = pretrained.plan(spec, "experiments.lm", model, abstract)
    # Every parameter comes from the checkpoint: none of the abstract leaves is left.
    params = init_from.place(the_plan, pretrained.read(the_plan, source, abstract), abstract)
    return net, params, the_plan


IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 24))


@pytest.mark.parametrize("family", FAMILIES)
def test_imported_logits_equal_hf(family, tmp_path):
    model = FAMILIES[family]()
    spec = save(model, tmp_path)
    net, params, the_plan = import_params(spec)
    assert not the_plan.fresh and not the_plan.unused, the_plan.details()
    got = np.asarray(jax.jit(net.apply)(params, jnp.asarray(IDS, jnp.int32)))
    np.testing.assert_allclose(got, hf_logits(model, IDS), rtol=1e-5, atol=1e-5)


def test_a_base_model_checkpoint_names_its_tensors_without_the_prefix(tmp_path):
    """The hub's original gpt2 was saved from GPT2Model: ``h.0.attn...``, ``wte.weight``."""
    model = gpt2()
    save(model, tmp_path / "lm")
    model.transformer.save_pretrained(tmp_path / "base", safe_serialization=True)
    assert "wte.weight" in SafetensorsDir(str(tmp_path / "base")).shapes
    net, params, the_plan = import_params(f"hf:{tmp_path / 'base'}")
    assert not the_plan.fresh and not the_plan.unused, the_plan.details()
    got = np.asarray(jax.jit(net.apply)(params, jnp.asarray(IDS, jnp.int32)))
    np.testing.assert_allclose(got, hf_logits(model, IDS), rtol=1e-5, atol=1e-5)


def test_a_sharded_checkpoint_streams_into_fsdp_shards_unscanned_too(tmp_path):
    model = llama()
    spec = save(model, tmp_path, max_shard_size="60KB")
    assert (tmp_path / INDEX).exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    repl = rp.Replicator(mesh={"data": 2, "fsdp": 4}, min_size=0)
    reference = hf_logits(model, IDS)
    for scan in (True, False):
        net, params, _ = import_params(spec, repl, scan_layers=scan)
        for leaf in jax.tree.leaves(params):  # each in its own shards, as the rules say
            assert "fsdp" in str(leaf.sharding.spec), leaf.sharding
        got = np.asarray(jax.jit(net.apply)(params, jnp.asarray(IDS, jnp.int32)))
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)


def test_the_model_keys_come_from_config_json_and_changes_are_named(tmp_path, caplog):
    spec = save(llama(), tmp_path)
    config = lm_config(spec, model=dict(vocab_size=256, num_layers=1, max_len=64, norm_eps=0.1))
    with caplog.at_level("INFO", logger="replicator"):
        shaped = pretrained.checkpoint_model(config)
    model = shaped.model.to_dict()
    assert (model["num_layers"], model["num_kv_heads"], model["rope_theta"]) == (2, 2, 500_000.0)
    assert model["max_len"] == 64 and model["rope_scaling"]["factor"] == 8.0  # max_len: ours
    (line,) = [r.message for r in caplog.records if "config.model changed" in r.message]
    assert "num_layers 1 -> 2" in line and "vocab_size 256 -> 300" in line
    assert "norm_eps 0.1 -> 1e-05" in line and "max_len" not in line
    caplog.clear()
    assert pretrained.checkpoint_model(shaped).model.to_dict() == model  # a saved config: as it is
    assert not caplog.records


def lm_config(spec, **kw):
    from tests.helpers.configs import CONFIG_DIR, load_config

    config = load_config(CONFIG_DIR / "lm_tiny.py", "smoke")
    config.init_from = spec
    for key, value in kw.items():
        config[key] = value
    return config


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Each bad input: its ``init_from`` and the words its one-line error must say."""
    from safetensors.numpy import save_file

    root = tmp_path_factory.mktemp("broken")
    save(llama(), root / "llama")
    files = SafetensorsDir(str(root / "llama"))
    hf_config = json.loads((root / "llama" / "config.json").read_text())
    missing, shapes, bert = root / "missing", root / "shapes", root / "bert"
    for directory in (missing, shapes, bert):
        directory.mkdir()
    kept = {n: np.asarray(files.read(n)) for n in files.shapes if "layers.1.mlp.up" not in n}
    save_file(kept, str(missing / "model.safetensors"), metadata={"format": "pt"})
    (missing / "config.json").write_text(json.dumps(hf_config))
    os.link(root / "llama" / "model.safetensors", shapes / "model.safetensors")
    (shapes / "config.json").write_text(json.dumps({**hf_config, "intermediate_size": 80}))
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    return {
        "unsupported_model_type": (f"hf:{bert}", "model_type='bert'"),
        "missing_tensor": (f"hf:{missing}", "model.layers.1.mlp.up_proj.weight missing"),
        "shape_mismatch": (f"hf:{shapes}", "is (96, 64), config.json says (80, 64)"),
        "missing_directory": (f"hf:{root / 'nowhere'}", "no directory"),
    }


BROKEN = ("unsupported_model_type", "missing_tensor", "shape_mismatch", "missing_directory")


@pytest.mark.parametrize("case", BROKEN)
def test_a_bad_checkpoint_is_one_config_error(case, broken):
    from experiments.lm.task import make_model

    spec, words = broken[case]
    with pytest.raises(ConfigError) as raised:
        config = pretrained.checkpoint_model(lm_config(spec))
        net = make_model(config.model.to_dict())
        tokens = jnp.zeros((1, 8), jnp.int32)
        abstract = jax.eval_shape(lambda: net.init(jax.random.key(0), tokens))
        pretrained.plan(spec, "experiments.lm", config.model.to_dict(), abstract)
    message = str(raised.value)
    assert words in message and "\n" not in message, message


# ---- Through the trainer: train, then export


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tfds"))


@pytest.mark.slow
def test_fine_tuning_an_import_on_one_device_freezes_skips_and_exports(tmp_path, data_dir, capsys):
    """GPT-2 in, a step with attention and the final norm frozen, that norm skipped (so
    initialised fresh) and the MLP at half the rate; out again in several files, which
    transformers loads."""
    from replicator import trainer
    from replicator.trainer.export import export_hf

    spec = save(gpt2(), tmp_path / "gpt2")
    original = SafetensorsDir(str(tmp_path / "gpt2"))
    config = lm_config(spec, num_train_steps=1, eval_every_steps=1, checkpoint_every_steps=1,
                       data_dir=data_dir, freeze="attention/|ln_final/", init_from_skip="ln_final/",
                       lr_mults=(("mlp/", 0.5),), learning_rate=0.01)  # fmt: skip
    trainer.train_and_evaluate(config, str(tmp_path / "run"), quiet=True, devices=jax.devices()[:1])
    err = capsys.readouterr().err
    assert "gpt2 (GPT2LMHeadModel): 2 layers, width 32, 4 heads of 8" in err
    assert "loaded 14 arrays, 2 initialised fresh (2 by init_from_skip), 0 in the checkpoint" in err
    exported = export_hf(str(tmp_path / "run"), str(tmp_path / "out"), max_file_bytes=40_000,
                         devices=jax.devices()[:1])  # fmt: skip
    assert exported.step == 1 and len([f for f in exported.files if f.endswith(".safetensors")]) > 2
    out = SafetensorsDir(str(tmp_path / "out"))
    assert set(out.shapes) == set(original.shapes)  # HF's names, every one
    for name in out.shapes:
        new, old = np.asarray(out.read(name)), np.asarray(original.read(name))
        if ".attn." in name:  # frozen: the checkpoint's, bit for bit
            np.testing.assert_array_equal(new, old)
        elif name.startswith("transformer.ln_f."):  # skipped and frozen: a fresh LayerNorm
            np.testing.assert_array_equal(new, np.ones_like(old) if "weight" in name else 0 * old)
        elif ".mlp." in name:
            assert not np.allclose(new, old)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), output_loading_info=True
    )
    assert not any(info.values()), info
    assert type(loaded).__name__ == "GPT2LMHeadModel"


def run_cli(*args, devices=8):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    env.pop("REPLICATOR_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "replicator", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def trained_logits(workdir, ids) -> np.ndarray:
    """The LM's logits with the parameters of the run's newest checkpoint."""
    from experiments.lm.task import make_model
    from replicator.checkpoints.checkpoint import Checkpoints
    from replicator.trainer.setup import setup

    config = run_config(str(workdir))
    run = setup(config, devices=jax.devices()[:1], training=False)
    checkpoints = Checkpoints(str(workdir / "checkpoints"), run.repl, read_only=True)
    params = checkpoints.restore(like={"params": run.abstract_state.params}, partial=True)
    checkpoints.close()
    run.close()
    net = make_model({**config.model.to_dict(), "attention": "xla"})
    return np.asarray(jax.jit(net.apply)(params, jnp.asarray(ids, jnp.int32)))


@pytest.mark.slow
def test_train_an_imported_llama_sharded_then_export_gives_hf_the_trained_logits(
    tmp_path, data_dir
):
    model = llama()
    spec = save(model, tmp_path / "llama")
    workdir, out = tmp_path / "run", tmp_path / "out"
    done = run_cli("train", "--config", "configs/lm_tiny.py:smoke", "--workdir", str(workdir),
                   f"--config.init_from={spec}", f"--config.data_dir={data_dir}",
                   "--config.num_train_steps=2", "--config.model.max_len=128",
                   "--config.mesh.data=2", "--config.mesh.fsdp=4", "--config.fsdp_min_size=0",
                   "--config.learning_rate=0.01")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "llama (LlamaForCausalLM): 2 layers, width 64, 4 heads of 16, 2 kv heads" in done.stderr
    assert "config.model changed: embed_dim 32 -> 64" in done.stderr
    done = run_cli("export", "--workdir", str(workdir), "--format", "hf", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exported step 2 to {out}" in done.stdout
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert type(exported).__name__ == "LlamaForCausalLM"
    ids = IDS[:, :16]
    got = hf_logits(exported, ids)
    np.testing.assert_allclose(got, trained_logits(workdir, ids), rtol=1e-4, atol=1e-4)
    assert np.abs(got - hf_logits(model, ids)).max() > 1e-2  # the trained weights, not the start


# The two that fail after the experiment is set up take 15-20 s each: test-slow.
CLI_BROKEN = [
    pytest.param(case, marks=pytest.mark.slow) if case in ("missing_tensor", "shape_mismatch")
    else case
    for case in BROKEN
]  # fmt: skip


@pytest.mark.parametrize("case", CLI_BROKEN)
def test_a_bad_checkpoint_on_the_command_line_is_one_line_and_writes_nothing(
    case, broken, tmp_path, data_dir
):
    spec, words = broken[case]
    workdir = tmp_path / "run"
    done = run_cli("train", "--config", "configs/lm_tiny.py:smoke", "--workdir", str(workdir),
                   f"--config.init_from={spec}", f"--config.data_dir={data_dir}",
                   "--config.model.max_len=128", devices=1)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    # (Before it, the line naming the model keys that the checkpoint's config.json changed.)
    line = done.stderr.splitlines()[-1]
    assert line.startswith("error: ") and words in line, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("error") == 1
    assert not workdir.exists()


def test_an_export_carries_the_runs_tokenizer_and_its_ids(tmp_path):
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    from experiments.lm.hf import hf_checkpoint

    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"])
    tokenizer.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainer)
    path = str(tmp_path / "tokenizer.json")
    tokenizer.save(path)
    model = pretrained.layout("experiments.lm", {"vocab_size": 300}, _gpt2_config()).model
    layout = hf_checkpoint(model, tokenizer=path)
    assert layout.files == (path,)
    assert layout.config["eos_token_id"] == tokenizer.token_to_id("<|endoftext|>")
    assert hf_checkpoint(model, tokenizer="bytes").config["eos_token_id"] == 0  # bytes: 0 ends


def _gpt2_config():
    return {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 300}


def test_model_keys_without_a_hugging_face_family_are_one_error():
    from experiments.lm.hf import hf_checkpoint

    with pytest.raises(ConfigError, match="no Hugging Face family"):
        hf_checkpoint({"positions": "rotary", "norm": "layernorm"})
    with pytest.raises(ConfigError, match="rope_type='yarn'"):
        llama_config = {"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}}
        hf_checkpoint({}, {**_llama_config(), **llama_config})
    with pytest.raises(ConfigError, match="sliding_window=16"):
        hf_checkpoint({"max_len": 64}, {**_llama_config(), "model_type": "mistral",
                                        "sliding_window": 16})  # fmt: skip


def _llama_config():
    return {
        "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 4,
    }  # fmt: skip
