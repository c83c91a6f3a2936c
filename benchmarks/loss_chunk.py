"""Temporary memory of an LM train step with the logits made whole or in chunks.

Compiles (does not run) ``jax.value_and_grad`` of the mean per-token loss of
``experiments.lm.Transformer`` for several ``loss_chunk`` values and prints
XLA's temporary bytes for each (``compiled.memory_analysis()``): what chunking
the logits saves does not depend on the device's speed, so CPU can show it.

    .venv/bin/python benchmarks/loss_chunk.py                      # GPT-2 width, 2 layers
    .venv/bin/python benchmarks/loss_chunk.py --layers 12 --batch 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--chunks", default="0,256,128")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    import jax
    import jax.numpy as jnp

    from experiments.lm import Transformer

    tokens = jnp.zeros((args.batch, args.seq), jnp.int32)
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        model = Transformer(
            vocab_size=args.vocab, num_layers=args.layers, num_heads=args.heads,
            embed_dim=args.width, max_len=args.seq, dtype=jnp.bfloat16, loss_chunk=chunk,
        )  # fmt: skip
        params = jax.eval_shape(model.init, jax.random.key(0), tokens)

        def loss(params, model=model):
            return jnp.mean(model.apply(params, tokens, targets=tokens))

        start = time.perf_counter()
        compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        rows.append(dict(loss_chunk=chunk, temp_bytes=temp))
        print(
            f"| {chunk or 'whole'} | {temp / 1e9:.2f} GB | "
            f"{time.perf_counter() - start:.1f} s to compile |",
            flush=True,
        )
    print(f"{jax.devices()[0].platform}, jax {jax.__version__}, {vars(args)}")
    out = os.path.join(ROOT, "benchmarks", "results", "loss_chunk.json")
    with open(out, "w") as f:
        json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), args=vars(args),
                       rows=rows), f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
