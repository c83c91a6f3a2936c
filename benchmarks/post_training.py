"""Post-training steps side by side: a DPO step against an SFT step of the same batch, and a
LoRA step against a full fine-tuning step.

Usage: .venv/bin/python benchmarks/post_training.py [--rounds N] [--steps K] [--small]

One worker process (benchmarks/trials.py) builds the LM experiment's own train steps
(`experiments.lm.make_experiment`, ``repl.compile`` on this host's CPU devices,
Adam) for one Llama-shaped model and one batch of packed windows, each window one
preference pair (chosen then rejected: segments 1 and 2, the completion tokens
marked), and times, interleaved and rotated every round:

* ``sft full`` / ``sft lora``: ``objective='sft'`` (the marked tokens' cross-entropy),
  every weight trained, or rank-16 adapters on every projection (the rest frozen);
* ``dpo full``: ``objective='dpo'`` without adapters: the policy's forward and
  backward passes plus the frozen reference copy's forward pass;
* ``dpo lora``: ``objective='dpo'`` with the adapters: the reference is the same
  kernels without them (a second forward pass, no copy).

Reports each candidate's median seconds per step and the medians of the per-round
ratios DPO / SFT (the reference's forward pass: about +1/3 of a step by FLOPs) and
LoRA / full (the frozen base still runs forward and backward through its
activations; LoRA saves the weight gradients and the optimizer's update of the
base). Writes benchmarks/results/post_training.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import trials

SHAPES = {
    "default": dict(
        vocab_size=1024,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        embed_dim=256,
        mlp_dim=768,
        max_len=256,
    ),  # fmt: skip
    "small": dict(
        vocab_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=64,
        mlp_dim=128,
        max_len=128,
    ),  # fmt: skip
}
LLAMA = dict(norm="rmsnorm", mlp_activation="swiglu", positions="rotary", use_bias=False,
             tie_embeddings=False, scan_layers=True, attention="xla")  # fmt: skip
CANDIDATES = {  # label -> (objective, LoRA rank)
    "sft full": ("sft", 0), "sft lora": ("sft", 16), "dpo full": ("dpo", 0),
    "dpo lora": ("dpo", 16),
}  # fmt: skip


def _batch(shape: dict, batch_size: int):
    """Windows of one pair each: a shared prompt, then chosen (segment 1) and rejected
    (segment 2) of equal length, their completions marked."""
    import numpy as np

    n, rng = shape["max_len"] + 1, np.random.default_rng(0)
    half, prompt = n // 2, n // 6
    tokens = rng.integers(6, shape["vocab_size"], (batch_size, n)).astype(np.int32)
    segments = np.where(np.arange(n) < half, 1, 2).astype(np.int32)[None].repeat(batch_size, 0)
    position = np.arange(n) % half
    loss_mask = (position >= prompt).astype(np.uint8)[None].repeat(batch_size, 0)
    return {"tokens": tokens, "segments": segments, "loss_mask": loss_mask}


def build(shape: str, batch_size: int) -> dict[str, trials.Candidate]:
    """The four candidates (worker side), sharing nothing but the batch."""
    import jax

    import replicator as rp
    from experiments.lm import make_experiment
    from experiments.lm.config import frozen_parameters
    from replicator.trainer.experiment import Settings
    from replicator.trainer.optimizer import OptimizerSpec, mark_frozen

    repl = rp.Replicator()
    dims = SHAPES[shape]
    example = _batch(dims, batch_size)
    out = {}
    for label, (objective, rank) in CANDIDATES.items():
        model = dict(dims, **LLAMA, lora_rank=rank, lora_alpha=32.0)
        frozen = frozen_parameters({"model": model, "objective": objective})
        spec = OptimizerSpec(learning_rate=1e-3, num_train_steps=10**6,
                             freeze=frozen[0] if frozen else None)  # fmt: skip
        settings = Settings(
            repl=repl, model=model, learning_rate=1e-3, optimizer="adam",
            num_train_steps=10**6, grad_accum_steps=1, seed=0, optimizer_spec=spec,
            options={"objective": objective, "tokenizer": "bytes"},
        )  # fmt: skip
        experiment = make_experiment(settings)
        batch = repl.shard_batch(experiment.preprocess(example))
        one = jax.tree.map(lambda x: x[0], experiment.preprocess(example))
        state = repl.init(lambda e=experiment, one=one: e.init_state(jax.random.key(0), one))
        if frozen:
            state = mark_frozen(state, frozen[0])
        step = repl.compile(experiment.train_step)
        holder = {"state": state}

        def run(k, step=step, holder=holder, batch=batch):
            for _ in range(k):
                holder["state"], sums = step(holder["state"], batch)
            return sums

        trained = sum(x.size for x in jax.tree.leaves(state.params))
        out[label] = trials.Candidate(run, {"objective": objective, "lora_rank": rank,
                                            "parameters": trained})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--small", action="store_true", help="a 2-layer width-64 model")
    args = parser.parse_args()
    shape = "small" if args.small else "default"
    spec = {"shape": shape, "batch_size": args.batch}
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    results, info = trials.run_workers(
        [("w", "post_training", "build", spec, env)], args.rounds, args.steps
    )
    per = trials.by_key(results)
    seconds = {k.split("/", 1)[1]: statistics.median(t.wall_s for t in ts) for k, ts in per.items()}

    def ratio(a: str, b: str) -> dict[str, float]:
        rounds = {t.round: t.wall_s for t in per[f"w/{a}"]}
        return trials.quartiles([rounds[t.round] / t.wall_s for t in per[f"w/{b}"]])

    ratios = {
        "dpo full / sft full": ratio("dpo full", "sft full"),
        "dpo lora / sft lora": ratio("dpo lora", "sft lora"),
        "sft lora / sft full": ratio("sft lora", "sft full"),
        "dpo lora / dpo full": ratio("dpo lora", "dpo full"),
    }
    import jax

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, model {shape}, "
          f"batch {args.batch} windows of {SHAPES[shape]['max_len'] + 1}")  # fmt: skip
    for label, s in seconds.items():
        print(f"| {label} | {s * 1e3:.1f} ms/step |")
    for name, q in ratios.items():
        print(f"| {name} | {q['median']:.2f} [{q['min']:.2f}-{q['max']:.2f}] |")
    out = os.path.join(trials.RESULTS_DIR, "post_training.json")
    with open(out, "w") as f:
        json.dump(dict(jax=jax.__version__, args=vars(args), seconds=seconds, ratios=ratios,
                       info=info), f, indent=1)  # fmt: skip
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
