"""Where the tutorial CNN's train step spends its time on XLA:CPU, op by op.

Usage: .venv/bin/python benchmarks/profile_step.py [--tuned] [--steps 10] [--top 20]
       .venv/bin/python benchmarks/profile_step.py --convs

Captures a JAX profiler trace of ``--steps`` hand-written jit steps (1 device,
global batch 256) and sums the duration of every XLA op (thunk) over all
threads. Loop fusions split over both cores count twice (once per thread),
and convolutions run by Eigen are asynchronous, so their events undercount;
use the numbers to rank ops, not to add up to the step time. ``--tuned``
applies the proposed CPU defaults (``benchmarks/cpu_defaults.py``) first.
Prints the table with each op's result shape and JAX op name.

``--convs`` instead times the model's convolutions alone (forward, input
gradient, weight gradient of both layers at batch 256), YNNPACK (this jaxlib's
default) against Eigen, interleaved, with freed memory kept (see
``cpu_defaults.keep_freed_memory``) so that allocation does not dominate.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

import cpu_defaults
import trials


def conv_table(rounds: int = 7, reps: int = 5) -> None:
    import statistics
    import time

    import jax
    import numpy as np
    from jax import lax

    cpu_defaults.keep_freed_memory()
    rng = np.random.default_rng(0)
    dims = ("NHWC", "HWIO", "NHWC")
    conv = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "VALID", dimension_numbers=dims)
    cases = {}
    for layer, (size, cin, cout) in {"conv1": (28, 1, 32), "conv2": (13, 32, 64)}.items():
        x = rng.random((256, size, size, cin), np.float32)
        k = rng.random((3, 3, cin, cout), np.float32)
        dy = rng.random((256, size - 2, size - 2, cout), np.float32)
        flops = 2 * dy.size * 9 * cin
        cases[f"{layer} forward"] = (conv, (x, k), flops)
        if cin > 1:
            dgrad = lambda k, dy, x=x: jax.vjp(lambda x: conv(x, k), x)[1](dy)[0]
            cases[f"{layer} input gradient"] = (dgrad, (k, dy), flops)
        wgrad = lambda x, dy, k=k: jax.vjp(lambda k: conv(x, k), k)[1](dy)[0]
        cases[f"{layer} weight gradient"] = (wgrad, (x, dy), flops)
    compiled = {}
    for name, (fn, args, flops) in cases.items():
        for backend, options in (("YNNPACK", None), ("Eigen", cpu_defaults.COMPILER_OPTIONS)):
            exe = jax.jit(fn, compiler_options=options).lower(*args).compile()
            device_args = jax.device_put(args)
            jax.block_until_ready(exe(*device_args))
            compiled[name, backend] = (exe, device_args, flops)
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for key, (exe, args, _) in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready([exe(*args) for _ in range(reps)])
            times[key].append((time.perf_counter() - start) / reps)
    print("| op | YNNPACK GFLOP/s | Eigen GFLOP/s | Eigen / YNNPACK |\n|---|---|---|---|")
    for name, (_, _, flops) in cases.items():
        rate = {b: flops / statistics.median(times[name, b]) / 1e9 for b in ("YNNPACK", "Eigen")}
        ratio = rate["Eigen"] / rate["YNNPACK"]
        print(f"| {name} | {rate['YNNPACK']:.0f} | {rate['Eigen']:.0f} | {ratio:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--convs", action="store_true")
    parser.add_argument("--tuned", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    if args.convs:
        conv_table()
        return
    sys.path.insert(0, trials.REPO_DIR)
    import jax

    options = None
    if args.tuned:
        cpu_defaults.apply_process_defaults()
        options = cpu_defaults.COMPILER_OPTIONS
    import cnn_steps

    cand = cnn_steps.build(paths=["jit"], compiler_options=options)["jit"]
    jax.block_until_ready(cand.run(3))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        jax.block_until_ready(cand.run(args.steps))
        jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        profile = jax.profiler.ProfileData.from_file(path)
    totals: collections.Counter[str] = collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            if line.name == "python":
                continue
            for event in line.events:
                if "ThunkExecutor" in event.name or event.name.startswith("$"):
                    continue
                totals[event.name] += event.duration_ns
    total = sum(totals.values())
    entry = cand.hlo[cand.hlo.index("\nENTRY") :]
    setting = "tuned" if args.tuned else "stock"
    print(f"summed op time: {total / args.steps / 1e6:.1f} ms/step ({setting} CPU settings)")
    print("| op | ms/step | share | HLO |\n|---|---|---|---|")
    for name, ns in totals.most_common(args.top):
        share = f"{ns / args.steps / 1e6:.2f} | {100 * ns / total:.0f}%"
        print(f"| {name} | {share} | {_describe(entry, name)} |")


def _describe(entry: str, name: str) -> str:
    """The result shape and the op_name metadata of HLO instruction ``name``."""
    match = re.search(rf"^\s*(?:ROOT )?%{re.escape(name)} = (\S+)[^\n]*", entry, re.MULTILINE)
    if not match:
        return ""
    op = re.search(r'op_name="([^"]*)"', match.group(0))
    return f"`{match.group(1)}` {op.group(1) if op else ''}".strip()


if __name__ == "__main__":
    main()
