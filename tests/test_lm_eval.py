"""lm-eval-harness on a run's checkpoint (``eval --tasks``), checked against lm_eval's HF backend.

Invariants: on the same weights, every request's answer (a continuation's
log-probability and ``is_greedy``, a rolling document's log-likelihood, a generated
text) and every task score equal what lm_eval's own Hugging Face backend (``--model
hf``, torch) gives, for a multiple-choice task, a generate_until task and a
loglikelihood_rolling task over local files; the scorer's fixed batches and length
buckets change no answer (each request equals its own unpadded forward pass, sharded
or not) and compile a program per bucket, not per request; bad input is one line.
"""

import importlib.util
import json
import os
import struct
import sys
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from replicator.errors import ConfigError, UsageError
from tests.helpers.cli import assert_refused, run_cli, snapshot
from tests.helpers.lm_eval_tasks import ANSWER_STOPS, CHOICE_PROMPT, TASKS, write_tasks
from tests.helpers.tiny_hf import write_tiny_llama

pytest.importorskip("lm_eval")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LEN = 64  # the model's context: one document spans several rolling windows


def _greedy_rows(hf_dir: str) -> tuple[list, list]:
    """A choice row whose answer is the model's greedy next token, and an answer row whose
    target is its greedy text (HF's own forward passes): is_greedy and exact_match true."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    choices = []
    for question in ("Say a word.", "What comes next?", "Name a thing.", "Go on."):
        ids = tokenizer.encode(CHOICE_PROMPT.format(question=question))
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        text = tokenizer.decode([token])
        if text.isascii() and text.strip():
            choices.append((question, [text, " nothing at all"], 0))
            break
    ids = torch.tensor([tokenizer.encode("Repeat after me:")])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=5)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    for stop in ANSWER_STOPS:
        text = text.split(stop)[0]
    return choices, [("Repeat after me:", text)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A random Llama (tokenizer and chat template beside it), the tasks, a tokenized corpus."""
    root = tmp_path_factory.mktemp("lm_eval")
    hf_dir = write_tiny_llama(str(root / "llama"), max_position_embeddings=MAX_LEN)
    choices, answers = _greedy_rows(hf_dir)
    tasks = write_tasks(str(root / "tasks"), more_choices=choices, more_answers=answers)
    corpus = root / "corpus"
    corpus.mkdir()
    text = json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 40})
    (corpus / "docs.jsonl").write_text((text + "\n") * 3)
    return types.SimpleNamespace(root=root, hf=hf_dir, tasks=tasks, corpus=str(corpus))


@pytest.fixture(scope="module")
def manager(files):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=files.tasks, include_defaults=False)  # local tasks only


@pytest.fixture(scope="module")
def hf_results(files, manager):
    """lm_eval's own HF backend (torch, float32) on the checkpoint directory."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={files.hf},dtype=float32,device=cpu",
        tasks=list(TASKS), task_manager=manager, batch_size=4, log_samples=True,
    )  # fmt: skip


def lm_config(files, **overrides) -> ml_collections.ConfigDict:
    """lm_tiny's smoke mode fine-tuning the Llama: its tokenizer, a corpus tokenized by it."""
    path = os.path.join(ROOT, "configs", "lm_tiny.py")
    spec = importlib.util.spec_from_file_location("lm_tiny", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("smoke")
    tokenizer = os.path.join(files.hf, "tokenizer.json")
    with config.unlocked():
        config.init_from = f"hf:{files.hf}"
        config.tokenizer = tokenizer
        config.dataset = (
            f"text_files/block_size=32,files={files.corpus}/*.jsonl,tokenizer={tokenizer}"
        )
        config.data_dir = str(files.root / "tfds")
        config.model.update(max_len=MAX_LEN, attention="xla")
        config.eval_batch_size = 6  # rounded up to 8 rows, one per device
        config.update(overrides)
    return config


@pytest.fixture(scope="module")
def trained(files):
    """A run of one step with every parameter frozen, sharded over 8 devices: its
    checkpoint holds the imported weights, bit for bit."""
    from replicator.trainer import train_and_evaluate

    workdir = str(files.root / "run")
    config = lm_config(files, num_train_steps=1, checkpoint_every_steps=1, eval_every_steps=1000,
                       freeze=".*")  # fmt: skip
    train_and_evaluate(config, workdir, quiet=True)
    return workdir


def assert_same_answers(ours, theirs):
    """Every request's answer, and every score, equal to float tolerance."""
    assert set(ours["results"]) == set(theirs["results"]) == set(TASKS)
    for task in TASKS:
        mine = sorted(ours["samples"][task], key=lambda s: s["doc_id"])
        ref = sorted(theirs["samples"][task], key=lambda s: s["doc_id"])
        assert [s["arguments"] for s in mine] == [s["arguments"] for s in ref]
        for a, b in zip(mine, ref):
            for x, y in zip(a["resps"], b["resps"]):
                x, y = x[0], y[0]
                if isinstance(y, str):  # generate_until: the text itself
                    assert x == y, (task, a["arguments"])
                elif isinstance(y, tuple):  # loglikelihood: (logprob, is_greedy)
                    np.testing.assert_allclose(x[0], y[0], rtol=1e-5, atol=1e-4)
                    assert x[1] == y[1], (task, a["arguments"])
                else:  # loglikelihood_rolling: the document's log-likelihood
                    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-3)
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float):
                np.testing.assert_allclose(ours["results"][task][metric], value, rtol=1e-5)


def read_scalars(directory) -> dict:
    """TensorBoard scalars, read from the event files' records by hand."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            while header := f.read(12):
                event = event_pb2.Event.FromString(f.read(struct.unpack("<Q", header[:8])[0]))
                f.read(4)
                for value in event.summary.value:
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_a_checkpoint_answers_every_request_as_lm_evals_hf_backend(trained, manager, hf_results):
    from replicator.trainer import harness

    # The data reach both branches: a greedy continuation, an exact match.
    choices = [x[0] for s in hf_results["samples"]["tiny_choice"] for x in s["resps"]]
    assert any(greedy for _, greedy in choices)
    assert hf_results["results"]["tiny_answer"]["exact_match,none"] > 0
    out = harness.evaluate_tasks(None, trained, TASKS, manager=manager, log_samples=True)
    assert out["step"] == 1
    assert_same_answers(out["lm_eval"], hf_results)
    # What it wrote: lm_eval's results JSON, a metrics record, TensorBoard scalars.
    assert os.path.dirname(out["path"]) == os.path.join(trained, "lm_eval")
    with open(out["path"]) as f:
        written = json.load(f)
    assert written["results"] == json.loads(json.dumps(out["results"]))
    assert "samples" not in written and written["config"]["model_args"].endswith("step=1")
    with open(os.path.join(trained, "metrics.jsonl")) as f:
        record = json.loads(f.readlines()[-1])
    assert record["split"] == "lm_eval" and record["step"] == 1
    assert record["tiny_choice/acc"] == out["results"]["tiny_choice"]["acc,none"]
    assert record["tiny_documents/bits_per_byte"] == pytest.approx(
        hf_results["results"]["tiny_documents"]["bits_per_byte,none"], rel=1e-5
    )
    scalars = read_scalars(os.path.join(trained, "tensorboard"))
    ((step, value),) = scalars["lm_eval/tiny_answer/exact_match"]  # float32
    assert step == 1 and value == pytest.approx(record["tiny_answer/exact_match"], rel=1e-6)


def _tiny_model(**keys):
    from experiments.lm.model import Transformer

    model = Transformer(vocab_size=256, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=16,
                        positions="rotary", norm="rmsnorm", mlp_activation="swiglu",
                        use_bias=False, attention="xla", **keys)  # fmt: skip
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x, params)  # peaked: no near-ties
    return model, params


def _right_padded(sequences, length):
    out = np.zeros((len(sequences), length), np.int32)
    for row, ids in enumerate(sequences):
        out[row, : len(ids)] = ids
    return out


def test_batches_and_buckets_change_no_answer_and_compile_per_bucket():
    """Requests of many lengths, sorted, batched and padded to buckets over a data x fsdp
    mesh: each answer is its own forward pass's on one device, for 2 score programs."""
    import replicator as rp
    from experiments.lm.harness import Scorer, load_harness_tokenizer
    from experiments.lm.sample import Sampler

    model, params = _tiny_model(max_len=32)
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 26, 21), rng.integers(1, 8, 21)
    requests = [(rng.integers(0, 256, c).tolist(), rng.integers(0, 256, x).tolist())
                for c, x in zip(*lengths)]  # fmt: skip
    forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens))
    first = int(np.argmax(forward(jnp.array([[7]]))[0, 0]))
    requests.append(([7], [first]))  # greedy, by construction
    repl = rp.Replicator(devices=jax.devices()[:4], mesh={"data": 2, "fsdp": 2}, min_size=0)
    boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    placed = jax.device_put(params, repl.param_shardings(boxed))
    scorer = Scorer(Sampler(model, repl=repl), load_harness_tokenizer("bytes"), batch_size=5)
    answers = scorer.loglikelihoods(placed, requests)
    assert scorer.batch_size == 8 and scorer.traces["score"] == 2  # buckets 16 and 32
    # The reference: every request alone in a row of the model's whole context, one device.
    logits = forward(_right_padded([c + x[:-1] for c, x in requests], 32))
    logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for row, ((context, continuation), (logprob, greedy)) in enumerate(zip(requests, answers)):
        at = np.arange(len(context) - 1, len(context) - 1 + len(continuation))
        expected = logprobs[row, at, continuation].sum()
        np.testing.assert_allclose(logprob, expected, rtol=1e-5, atol=1e-4)
        assert greedy == (logprobs[row, at].argmax(-1).tolist() == continuation)
    assert answers[-1][1]


def test_greedy_generations_stop_at_the_stop_strings_in_fixed_batches():
    """The scorer's generations are greedy (each token the argmax of a full forward pass),
    cut before the first token that holds a stop string; two batches of prompts of
    different lengths share one program pair (one bucket)."""
    import string

    import replicator as rp
    from experiments.lm.harness import Scorer, load_harness_tokenizer
    from experiments.lm.sample import Sampler

    model, params = _tiny_model(max_len=40)
    prompts = [list(b"x" * 12), list(b"hello"), list(b"ab"), list(b"q")]
    repl = rp.Replicator(devices=jax.devices()[:2], mesh={"data": 2})
    scorer = Scorer(Sampler(model, repl=repl), load_harness_tokenizer("bytes"), batch_size=2)
    stops = set(string.ascii_letters.encode()) | {0}  # the byte 0 ends a document
    got = scorer.generate(params, prompts, max_new_tokens=8, stop=list(string.ascii_letters))
    logits = model.apply({"params": params}, _right_padded([p + g for p, g in zip(prompts, got)],
                                                           40))  # fmt: skip
    for row, (prompt, ids) in enumerate(zip(prompts, got)):
        argmax = np.argmax(np.asarray(logits[row]), axis=-1)[len(prompt) - 1 :].tolist()
        assert argmax[: len(ids)] == ids and not stops & set(ids)
        assert len(ids) == 8 or argmax[len(ids)] in stops  # cut where a stop came
    assert any(len(ids) < 8 for ids in got)
    assert scorer.sampler.traces["prefill"] == 1  # batches of longest 12 and 2: bucket 16


def test_bad_inputs_are_one_line(monkeypatch, manager):
    from replicator.trainer import harness

    with pytest.raises(UsageError, match="knows no task 'tiny_chioce' \\(did you mean tiny_choice"):
        harness.check_tasks(["tiny_choice", "tiny_chioce"], manager)
    with pytest.raises(UsageError, match="--tasks is empty"):
        harness.check_tasks([" "], manager)
    run = types.SimpleNamespace(config=ml_collections.ConfigDict({"experiment": "experiments.gan"}))
    with pytest.raises(ConfigError, match="'experiments.gan' cannot run lm-eval-harness tasks"):
        harness._make_scorer(run)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if the extra were not installed
    with pytest.raises(UsageError, match=r"pip install -e '.\[eval\]'"):
        harness.import_lm_eval()


def test_a_bad_include_path_on_the_command_line_is_one_line_and_writes_nothing(trained, files):
    before = snapshot(trained)
    done = run_cli("eval", "--workdir", trained, "--tasks", "tiny_choice",
                   "--include_path", str(files.root / "nowhere"), devices=1)  # fmt: skip
    assert_refused(done, f"--include_path {files.root / 'nowhere'} is not a directory")
    assert snapshot(trained) == before


@pytest.mark.slow  # indexing lm_eval's 14,000 task YAMLs: ~13 s; test_bad_inputs_are_one_line
def test_an_unknown_task_on_the_command_line_is_one_line_and_writes_nothing(trained, files):
    before = snapshot(trained)
    done = run_cli("eval", "--workdir", trained, "--tasks", "tiny_choice,no_such_task",
                   "--include_path", files.tasks, devices=1)  # fmt: skip
    assert_refused(done, "lm_eval knows no task 'no_such_task'")
    assert snapshot(trained) == before


@pytest.mark.slow  # a CLI run of 3 tasks: ~20 s; the in-process test holds the invariant
def test_the_command_prints_one_json_line_and_writes_the_results(trained, files, hf_results):
    done = run_cli("eval", "--workdir", trained, "--tasks", ",".join(TASKS),
                   "--include_path", files.tasks, "--json", devices=8)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = done.stdout.splitlines()
    shown = json.loads(line)
    assert shown["step"] == 1 and os.path.isfile(shown["path"])
    for task in TASKS:
        for metric, value in hf_results["results"][task].items():
            if isinstance(value, float):
                np.testing.assert_allclose(shown["results"][task][metric], value, rtol=1e-5)
    with open(os.path.join(trained, "metrics.jsonl")) as f:
        record = json.loads(f.readlines()[-1])
    assert record["split"] == "lm_eval" and record["step"] == 1 and "tiny_choice/acc" in record


@pytest.mark.slow  # setup, a fresh init, HF again: ~11 s; the checkpoint test holds the rest
def test_without_a_checkpoint_the_import_is_scored_with_a_limit(files, manager):
    import lm_eval

    from replicator.trainer import harness

    ours = harness.evaluate_tasks(lm_config(files), str(files.root / "fresh"), TASKS,
                                  manager=manager, limit=3, log_samples=True)  # fmt: skip
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={files.hf},dtype=float32,device=cpu",
        tasks=list(TASKS), task_manager=manager, batch_size=4, log_samples=True, limit=3,
    )  # fmt: skip
    assert ours["step"] is None and os.path.basename(ours["path"]).startswith("results_init_from_")
    assert all(len(samples) == 3 for samples in ours["lm_eval"]["samples"].values())
    assert_same_answers(ours["lm_eval"], theirs)
