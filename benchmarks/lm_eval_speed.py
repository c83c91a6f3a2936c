"""lm-eval-harness requests per second: ours (``eval --tasks``) against lm_eval's HF backend.

One random ``LlamaForCausalLM`` checkpoint (written here, offline; its byte-level BPE
tokenizer from ``tests/helpers/tiny_hf.py``) is scored by both backends in one
process on the same CPU: lm_eval's ``HFLM`` (``--model hf``: torch, float32) and our
`replicator.trainer.harness.harness_model` over the LM's scorer (JAX, float32, the
run's mesh on this host's devices), with the same batch size. Each trial hands one
backend one kind of request, the way lm_eval's evaluator does:

* ``loglikelihood``: multiple-choice style, four continuations of a few tokens after
  contexts of 20 to 200 tokens;
* ``loglikelihood_rolling``: documents of 100 to 1,000 tokens (rolling windows);
* ``generate_until``: greedy, ``max_gen_toks`` tokens at most, until a blank line.

The first call of each (backend, kind) warms up (our programs compile then); then
the trials are interleaved, the order rotated every round, so that load from other
users of this machine hits both alike; we report each one's median requests per
second and the median of the per-round ratios. The two backends' answers are
checked to agree before timing (log-likelihoods to 1e-3, generated text equal).

    .venv/bin/python benchmarks/lm_eval_speed.py                # ~3 minutes on 2 cores
    .venv/bin/python benchmarks/lm_eval_speed.py --rounds 3 --small
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {
    "default": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),  # fmt: skip
    "small": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),  # fmt: skip
}
KINDS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def make_requests(count: int, seed: int = 0, max_gen_toks: int = 32) -> dict[str, list]:
    """``count`` lm_eval requests of each kind, over words of the tokenizer's texts."""
    import random

    from lm_eval.api.instance import Instance

    from tests.helpers.tiny_hf import TEXTS

    rng = random.Random(seed)
    words = " ".join(TEXTS).split()

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    def instance(kind: str, arguments: tuple, i: int) -> Instance:
        return Instance(request_type=kind, doc={}, arguments=arguments, idx=i)

    until = {"until": ["\n\n"], "max_gen_toks": max_gen_toks, "do_sample": False}
    requests: dict[str, list] = {kind: [] for kind in KINDS}
    for i in range(count):
        context = text(rng.randint(8, 80))
        for choice in range(4):  # a question's four answers, as multiple choice asks
            requests["loglikelihood"].append(
                instance("loglikelihood", (context, " " + text(rng.randint(1, 4))), choice)
            )
        requests["loglikelihood_rolling"].append(
            instance("loglikelihood_rolling", (text(rng.randint(40, 400)),), i)
        )
        requests["generate_until"].append(
            instance("generate_until", (text(rng.randint(8, 80)), dict(until)), i)
        )
    requests["loglikelihood"] = requests["loglikelihood"][:count]
    return requests


def hf_backend(directory: str, batch_size: int):
    """lm_eval's own HF backend on the checkpoint directory."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=directory, dtype="float32", device="cpu", batch_size=batch_size)


def our_backend(directory: str, batch_size: int, max_len: int):
    """Our lm_eval model over the checkpoint imported as ``init_from='hf:DIR'``."""
    import importlib.util

    from replicator.trainer import harness, pretrained, sample_command
    from replicator.trainer.setup import setup

    path = os.path.join(REPO_DIR, "configs", "lm_tiny.py")
    spec = importlib.util.spec_from_file_location("lm_tiny", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    tokenizer = os.path.join(directory, "tokenizer.json")
    root = tempfile.mkdtemp(prefix="lm_eval_speed_")
    corpus = os.path.join(root, "corpus.jsonl")
    with open(corpus, "w") as f:  # setup reads an eval split: a little text in its tokens
        f.writelines(json.dumps({"text": "The quick brown fox. " * 200}) + "\n" for _ in range(3))
    with config.unlocked():
        config.update(init_from=f"hf:{directory}", tokenizer=tokenizer, eval_batch_size=batch_size,
                      data_dir=os.path.join(root, "tfds"))  # fmt: skip
        config.dataset = f"text_files/block_size=64,files={corpus},tokenizer={tokenizer}"
        config.model.update(max_len=max_len)
    config = pretrained.checkpoint_model(config, required=False)
    run = setup(config, training=False)
    scorer = harness._make_scorer(run)
    params, _ = sample_command.restore_params(run, os.path.join(root, "run"), None, False)
    return harness.harness_model(scorer, params)


def check_agreement(ours, theirs, requests) -> None:
    """Both backends give the same answers (else the timing compares different work)."""
    import numpy as np

    few = {kind: reqs[:8] for kind, reqs in requests.items()}
    a, b = ours.loglikelihood(few["loglikelihood"]), theirs.loglikelihood(few["loglikelihood"])
    np.testing.assert_allclose([x for x, _ in a], [x for x, _ in b], rtol=1e-4, atol=1e-3)
    a = ours.loglikelihood_rolling(few["loglikelihood_rolling"])
    b = theirs.loglikelihood_rolling(few["loglikelihood_rolling"])
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-2)
    a, b = ours.generate_until(few["generate_until"]), theirs.generate_until(few["generate_until"])
    same = sum(x == y for x, y in zip(a, b))
    print(f"agreement: log-likelihoods equal; {same}/{len(a)} generations identical")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=64, help="requests of each kind")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_len", type=int, default=512, help="the model's context")
    parser.add_argument("--small", action="store_true", help="a 2-layer, 64-wide model")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, REPO_DIR)
    from tests.helpers.tiny_hf import write_tiny_llama

    shape = SHAPES["small" if args.small else "default"]
    directory = write_tiny_llama(tempfile.mkdtemp(prefix="llama_"),
                                 max_position_embeddings=args.max_len, **shape)  # fmt: skip
    requests = make_requests(args.requests)
    backends = {"ours": our_backend(directory, args.batch_size, args.max_len),
                "hf": hf_backend(directory, args.batch_size)}  # fmt: skip
    check_agreement(backends["ours"], backends["hf"], requests)
    for lm in backends.values():  # warm-up: our programs compile here
        for kind in KINDS:
            getattr(lm, kind)(requests[kind])
    times = {(name, kind): [] for name in backends for kind in KINDS}
    pairs = list(times)
    for r in range(args.rounds):
        for name, kind in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:
            start = time.perf_counter()
            getattr(backends[name], kind)(requests[kind])
            times[name, kind].append(time.perf_counter() - start)
    report = summarize(times, requests, args, shape)
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def summarize(times, requests, args, shape) -> dict:
    """Median requests per second of each backend and kind, and of the per-round ratios."""
    out = {"shape": shape, "max_len": args.max_len, "batch_size": args.batch_size,
           "rounds": args.rounds, "cpus": os.cpu_count(), "kinds": {}}  # fmt: skip
    for kind in KINDS:
        n = len(requests[kind])
        ours, hf = times["ours", kind], times["hf", kind]
        out["kinds"][kind] = {
            "requests": n,
            "ours_per_s": round(n / statistics.median(ours), 1),
            "hf_per_s": round(n / statistics.median(hf), 1),
            "speedup_median": round(statistics.median(h / o for o, h in zip(ours, hf)), 2),
            "speedup_range": [
                round(min(h / o for o, h in zip(ours, hf)), 2),
                round(max(h / o for o, h in zip(ours, hf)), 2),
            ],  # fmt: skip
        }
    return out


if __name__ == "__main__":
    main()
