"""Decode throughput: `experiments.lm.sample.Sampler` on configs/lm_tiny.py, on CPU.

Usage: .venv/bin/python benchmarks/decode.py [--config configs/lm_tiny.py] [--trials 5]
       [--batch 1,8] [--prompt_len 16] [--new 112] [--devices 1]

The config's model (lm_tiny: 2 layers, 128 wide, 4 heads, max_len 128, learned
positions, byte vocabulary) with random parameters (throughput does not depend
on the weights), prompts of ``--prompt_len`` tokens continued by ``--new``
tokens with no stop token, so every call generates ``batch * new`` tokens. One
call per trial (one prefill, ``new - 1`` decode steps, each a dispatch of the
once-compiled step), after a first call that compiles; the median over trials.
Greedy, and temperature 1.0 with top-k 40 (a `lax.top_k` filter and a draw per
row). ``--devices N`` runs on a `replicator.Replicator` of N (fake) CPU devices,
the batch split over them; 1 (the default) is plain `jax.jit` on one device.
Writes benchmarks/results/decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/lm_tiny.py")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--new", type=int, default=112)
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args(argv)
    if args.devices > 1:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    sys.path.insert(0, ROOT)
    import importlib.util

    import jax
    import jax.numpy as jnp

    import replicator as rp
    from experiments.lm.sample import Sampler, SamplingOptions
    from experiments.lm.task import make_model

    spec = importlib.util.spec_from_file_location("config", os.path.join(ROOT, args.config))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    model = make_model(config.model.to_dict())
    params = model.init(jax.random.key(0), jnp.zeros((1, model.max_len), jnp.int32))["params"]
    repl = None
    if args.devices > 1:
        repl = rp.Replicator(mesh={"data": args.devices})
        params = repl.replicate(params)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        prompts = [[(7 * i + j) % model.vocab_size for j in range(args.prompt_len)]
                   for i in range(batch)]  # fmt: skip
        for name, options in (
            ("greedy", dict(temperature=0.0)),
            ("t1_top40", dict(temperature=1.0, top_k=40)),
        ):
            sampler = Sampler(model, repl=repl)
            opts = SamplingOptions(max_new_tokens=args.new, stop_ids=(), **options)
            start = time.perf_counter()
            sampler.generate(params, prompts, opts)
            compile_s = time.perf_counter() - start
            seconds = []
            for trial in range(args.trials):
                opts = SamplingOptions(max_new_tokens=args.new, stop_ids=(), seed=trial, **options)
                start = time.perf_counter()
                samples = sampler.generate(params, prompts, opts)
                seconds.append(time.perf_counter() - start)
                assert sum(len(s.ids) for s in samples) == batch * args.new
            median = statistics.median(seconds)
            row = dict(
                batch=batch, sampling=name, prompt_len=args.prompt_len, new_tokens=args.new,
                devices=args.devices, first_call_s=round(compile_s, 3),
                median_s=round(median, 4), min_s=round(min(seconds), 4),
                tokens_per_s=round(batch * args.new / median, 1),
                ms_per_step=round(1e3 * median / args.new, 3), traces=dict(sampler.traces),
            )  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = dict(
        config=args.config, backend=jax.default_backend(), cpu_count=os.cpu_count(),
        jax=jax.__version__, rows=rows,
    )  # fmt: skip
    path = os.path.join(ROOT, "benchmarks", "results", "decode.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
