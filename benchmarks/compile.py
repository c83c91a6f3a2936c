"""Compile: one compilation per run, cold compile time, and the persistent cache.

Usage: .venv/bin/python benchmarks/compile.py [--rounds 3] [--devices 2]

Each round starts three fresh processes in turn, each building the tutorial CNN
train step under `Replicator.compile` and `Replicator.run` and training 10
steps, one eval-like call, and 10 more:

* ``cold``: no persistent compilation cache;
* ``cache, 1st process``: `jax_compilation_cache_dir` set to a new, empty
  directory (``jax_persistent_cache_min_compile_time_secs=0``,
  ``jax_persistent_cache_min_entry_size_bytes=-1``): compiles and writes it;
* ``cache, 2nd process``: the same directory again: loads the executables.

Each process asserts that both train steps were compiled by XLA exactly once
(``jax.monitoring`` backend-compile events), records the jitted function's
``_cache_size()`` (entries in JAX's C++ dispatch cache), and reports JAX's own
compile-phase timings (``jax.monitoring``: trace, lower to MLIR, XLA compile
or cache load). Writes benchmarks/results/compile.json.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import trials

STEPS = 10
KINDS = ("cold", "cache, 1st process", "cache, 2nd process")
EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "xla_compile_s",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load_s",
}


def child(cache_dir: str | None) -> dict:
    """One fresh process: first-call and steady step times of both paths."""
    import jax

    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    durations: dict[str, float] = collections.defaultdict(float)
    xla_compiles: list[str] = []

    def listen(event, secs, fun_name=None, **_):
        durations[event] += secs
        if event == "/jax/core/compile/backend_compile_duration":
            xla_compiles.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    import cnn_steps
    import optax

    import replicator as rp
    from replicator.step.state import TrainState

    model = cnn_steps.make_model()
    host_batch = cnn_steps.synthetic_batch()
    params = jax.device_get(model.init(jax.random.key(0), host_batch["image"][:1])["params"])
    out = {"devices": jax.device_count()}
    for path in ("replicator_compile", "replicator_run"):
        repl = rp.Replicator()
        tx = repl.wrap_optimizer(optax.adam(1e-3))
        state = repl.replicate(TrainState.create(params, tx, jax.random.key(0)))
        batch = repl.shard_batch(host_batch)
        train_step = cnn_steps.replicator_step(model, tx)
        if path == "replicator_compile":
            compiled = repl.compile(train_step, donate_argnums=(0,))
            step = lambda s, c=compiled, b=batch: c(s, b)
        else:
            step = lambda s, r=repl, f=train_step, b=batch: r.run(f, s, b, donate_argnums=(0,))

        def eval_step(state):
            return state.step + 1

        eval_fn = repl.compile(eval_step)
        before, compiles_before = dict(durations), len(xla_compiles)
        start = time.perf_counter()
        state, metrics = step(state)
        jax.block_until_ready(metrics)
        first = time.perf_counter() - start
        compile_phases = {
            name: durations.get(event, 0.0) - before.get(event, 0.0)
            for event, name in EVENTS.items()
        }
        for _ in range(STEPS - 1):
            state, metrics = step(state)
        jax.block_until_ready(eval_fn(state))
        start = time.perf_counter()
        for _ in range(STEPS):
            state, metrics = step(state)
        jax.block_until_ready(metrics)
        steady = (time.perf_counter() - start) / STEPS
        jitted = compiled.jitted if path == "replicator_compile" else _only(repl._run_cache)
        step_compiles = [f for f in xla_compiles[compiles_before:] if "eval_step" not in f]
        out[path] = {
            "first_step_s": first,
            "steady_step_s": steady,
            "compile_overhead_s": first - steady,
            "xla_compilations": len(step_compiles),
            "jit_cache_entries": jitted._cache_size(),
            **compile_phases,
        }
        assert len(step_compiles) == 1, (path, step_compiles)
    return out


def _only(cache: dict):
    ((jitted, _),) = cache.values()  # Replicator._run_cache: key -> (jitted, metadata)
    return jitted


def _run_child(devices: int, cache_dir: str | None) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    argv = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(cache_dir)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"compile child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(rounds: int, devices: int) -> dict:
    runs = {kind: [] for kind in KINDS}
    root = tempfile.mkdtemp(prefix="replicator-compile-cache-")
    try:
        for r in range(rounds):
            cache_dir = os.path.join(root, str(r))
            runs["cold"].append(_run_child(devices, None))
            runs["cache, 1st process"].append(_run_child(devices, cache_dir))
            runs["cache, 2nd process"].append(_run_child(devices, cache_dir))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = {}
    for kind, results in runs.items():
        for path in ("replicator_compile", "replicator_run"):
            rows = [res[path] for res in results]
            summary[f"{kind}/{path}"] = {
                field: statistics.median(row[field] for row in rows)
                for field in rows[0]
                if field not in ("xla_compilations", "jit_cache_entries")
            } | {
                "xla_compilations": max(row["xla_compilations"] for row in rows),
                "jit_cache_entries": max(row["jit_cache_entries"] for row in rows),
            }
    return {"devices": devices, "summary": summary, "raw": runs}


def render(result: dict) -> str:
    lines = [
        "## Compile time",
        "",
        f"The tutorial CNN train step on {result['devices']} fake CPU devices, in fresh "
        f"processes, median of {result['rounds']} rounds (each round: one process "
        "without a persistent cache, then two in a row sharing a new cache directory). "
        "*First step* is the wall time of the first call (trace + lower + compile or "
        "cache load + one step); *overhead* subtracts a steady step. Phases come from "
        "`jax.monitoring`. Every process trained 20 steps with an eval-like call in "
        "between and asserted that the train step was compiled by XLA exactly once "
        "(*XLA compiles*, counted from `jax.monitoring`'s backend-compile events). "
        "*jit cache* is the jitted function's `_cache_size()`, the number of entries in "
        "JAX's C++ dispatch cache, largest seen.",
        "",
        "| process | path | first step s | overhead s | trace s | lower s | XLA compile s "
        "| cache load s | XLA compiles | jit cache |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in result["summary"].items():
        kind, path = key.split("/")
        lines.append(
            f"| {kind} | {path} | {row['first_step_s']:.2f} | {row['compile_overhead_s']:.2f} | "
            f"{row['trace_s']:.2f} | {row['lower_s']:.2f} | {row['xla_compile_s']:.2f} | "
            f"{row['cache_load_s']:.2f} | {row['xla_compilations']} | "
            f"{row['jit_cache_entries']} |"
        )
    lines += [
        "",
        "The cache settings are JAX's (`jax_compilation_cache_dir`, "
        "`jax_persistent_cache_min_compile_time_secs=0`, "
        "`jax_persistent_cache_min_entry_size_bytes=-1`). `python -m replicator train` "
        "and `eval` turn the cache on by default (`--compile_cache`, default "
        "`~/.cache/replicator/jax`, for programs that took at least 0.5 s to compile; "
        "`--compile_cache=''` turns it off).",
        "",
        f"Command: `{result['command']}`",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.path.insert(0, trials.REPO_DIR)
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    trials.run_main("compile", __doc__, measure, [render], {"rounds": 3, "devices": 2})


if __name__ == "__main__":
    main()
