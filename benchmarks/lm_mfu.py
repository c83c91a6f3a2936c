"""The LM experiment's own train step on this device: tokens/s and MFU per setting.

Usage: .venv/bin/python benchmarks/lm_mfu.py [--config configs/lm_1b.py] [--batch 8]
       [--steps 4] [--rounds 3] [--variants 'NAME;NAME...'] [--timeout 120]

Each variant is the config (``configs/lm_1b.py`` by default: 20 scanned blocks,
d=2048, 1.01B parameters, bf16 compute over f32 parameters, AdamW, FSDP mesh
over this host's devices) with a few keys changed, trained by the framework's
own step (`replicator.trainer.setup`: the step ``python -m replicator train``
runs) on one real batch of its dataset, in a process of its own (XLA flags are
read when JAX starts; an out-of-memory variant fails alone). Per variant: the
first step (compile + run), then ``--rounds`` timings of ``--steps`` steps each,
waited for at the end; the median per-step time.

MFU counts model FLOPs, 6·N·T + 12·L·S·d·T per step (N parameters without the
position table, T tokens, L layers, S sequence, d width: the PaLM/nanoGPT count,
attention as if not causal, recomputation not counted), against the data-sheet
dense bf16 peak (H100/H200: 989 TFLOP/s); "HFU" counts the matrix FLOPs of the
compiled step instead (`replicator.compiled.hlo`: recomputation included). On CPU there
is no data-sheet peak: only tokens/s. Writes benchmarks/results/lm_mfu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import trials

# One step, no microbatches (the shipped config's four are for a v5e-16's 16 chips).
_ONE = {"grad_accum_steps": 1}
# name -> (config overrides, extra XLA_FLAGS)
VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "remat full": ({**_ONE, "remat_policy": "full"}, ""),
    "remat minimal": ({**_ONE, "remat_policy": "minimal"}, ""),
    "remat none": ({**_ONE, "remat_policy": None}, ""),
    "remat none, bf16 first moment": (
        {
            **_ONE,
            "remat_policy": None,
            "optimizer_args": {"b1": 0.9, "b2": 0.95, "mu_dtype": "bfloat16"},
        },
        "",
    ),  # fmt: skip
    "remat none, no Triton GEMM": (
        {**_ONE, "remat_policy": None},
        "--xla_gpu_enable_triton_gemm=false",
    ),  # fmt: skip
    "remat full, XLA attention": ({**_ONE, "remat_policy": "full", "model.attention": "xla"}, ""),
}
_TAG = "@@lm_mfu "


def worker(config_path: str, name: str, batch: int, steps: int, rounds: int) -> dict[str, Any]:
    """One variant, in this process: its step timed on one real batch."""
    import jax

    from replicator.compiled import hlo as hlo
    from replicator.trainer.config_files import read_config_file
    from replicator.trainer.peaks import data_sheet_peak
    from replicator.trainer.setup import setup

    overrides, _ = VARIANTS[name]
    path, _, mode = config_path.partition(":")
    config = read_config_file(path, *([mode] if mode else []))
    with config.unlocked():
        config.batch_size = batch
        config.eval_batch_size = batch
        for key, value in overrides.items():
            *parents, leaf = key.split(".")
            target = config
            for parent in parents:
                target = target[parent]
            target[leaf] = value
    run = setup(config)
    batches = run.repl.distribute(run.train_iterator())
    data = next(batches)
    state = run.init_state()
    start = time.perf_counter()
    state, _, _ = run.train_step(state, data)
    jax.block_until_ready(state)
    first = time.perf_counter() - start
    per_step = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            state, sums, _ = run.train_step(state, data)
        jax.block_until_ready((state, sums))
        per_step.append((time.perf_counter() - start) / steps)
    program = run.train_step.lower(state, data).compile().as_text()
    devices = list(run.repl.mesh.devices.flat)
    hlo_flops = hlo.analyze(program).flops * len(devices)
    m = config.model
    params = sum(x.size for x in jax.tree.leaves(run.abstract_state.params))
    if m.get("positions", "learned") == "learned":
        params -= m.max_len * m.embed_dim
    tokens = batch * m.max_len
    model_flops = 6 * params * tokens + 12 * m.num_layers * m.max_len * m.embed_dim * tokens
    step_s = statistics.median(per_step)
    peak = data_sheet_peak(devices[0].device_kind)
    peak = None if peak is None else peak[0] * len(devices)
    stats = devices[0].memory_stats() or {}
    return {
        "variant": name,
        "device": devices[0].device_kind,
        "num_devices": len(devices),
        "jax": jax.__version__,
        "params_n": params,
        "tokens_per_step": tokens,
        "first_step_s": first,
        "step_s": step_s,
        "step_s_rounds": per_step,
        "tokens_per_s": tokens / step_s,
        "model_flops": model_flops,
        "hlo_flops": hlo_flops,
        "mfu": None if peak is None else model_flops / step_s / peak,
        "hfu": None if peak is None else hlo_flops / step_s / peak,
        "peak_bytes": stats.get("peak_bytes_in_use"),
    }


def measure(config: str, batch: int, steps: int, rounds: int, variants: list[str],
            timeout: int) -> dict[str, Any]:  # fmt: skip
    rows = []
    for name in variants:
        env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_MEM_FRACTION="0.92")
        flags = VARIANTS[name][1]
        if flags:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
        cmd = [sys.executable, __file__, "--worker", name, "--config", config,
               "--batch", str(batch), "--steps", str(steps), "--rounds", str(rounds)]  # fmt: skip
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            out = done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            out = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout} s"
        line = next((x for x in out.splitlines() if x.startswith(_TAG)), None)
        if line is None:
            tail = [x for x in out.strip().splitlines() if x.strip()][-3:]
            row = {"variant": name, "error": " | ".join(tail)[-400:]}
        else:
            row = json.loads(line[len(_TAG) :])
        row["wall_s"] = time.perf_counter() - start
        rows.append(row)
        print(render_row(row), flush=True)
    return {"config": config, "batch": batch, "steps": steps, "rounds": rounds, "rows": rows}


def render_row(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"| {row['variant']} | failed: {row['error']} |||||||"
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"
    gib = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**30:.1f}"
    return (
        f"| {row['variant']} | {row['step_s'] * 1e3:.1f} | {row['tokens_per_s']:,.0f} | "
        f"{pct(row['mfu'])} | {pct(row['hfu'])} | {gib} | {row['first_step_s']:.0f} | "
        f"{row['device']} | {row['jax']} |"
    )


def render(result: dict[str, Any]) -> str:
    lines = [
        f"{result['config']}, batch {result['batch']}; median of {result['rounds']} rounds "
        f"of {result['steps']} steps.",
        "",
        "| variant | ms/step | tokens/s | MFU | HFU | peak GiB | first step s | device | JAX |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(lines + [render_row(r) for r in result["rows"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/lm_1b.py")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=";".join(VARIANTS), help="';'-separated")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per variant")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        row = worker(args.config, args.worker, args.batch, args.steps, args.rounds)
        print(_TAG + json.dumps(row), flush=True)
        return
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    result = {"command": trials.command(), "machine": trials.machine()}
    result |= measure(args.config, args.batch, args.steps, args.rounds, variants, args.timeout)
    path = trials.write_result("lm_mfu", result)
    print(render(result))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
