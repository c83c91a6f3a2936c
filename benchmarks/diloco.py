"""DiLoCo vs synchronous data parallelism: quality, and bytes sent between islands.

Usage: .venv/bin/python benchmarks/diloco.py [--digits-h 5,20,50,100] [--lm-h 5,10,30]
       [--workdir runs/diloco_bench] [--docs-only]

For ``configs/digits_cnn_diloco.py`` and ``configs/lm_tiny_diloco.py`` (4 islands
of 2 replicas on 8 fake CPU devices), trains their synchronous originals
(``digits_cnn.py``, ``lm_tiny.py``: data parallelism over the same 8 replicas)
and DiLoCo at each H through the trainer's command line, and reads each run's
final eval from its ``metrics.jsonl``. The bytes each device sends between
islands per step are measured from the compiled train step's HLO
(`replicator.parallel.diloco.traffic`: collectives whose groups span islands, ring
model; the sync's, inside its conditional, divided by H); data parallelism's
from its step on the islands' mesh (``diloco=None``). A finished run is not repeated. Writes
benchmarks/results/diloco.json and prints the ``## DiLoCo`` section of
docs/benchmarks.md; ``--docs-only`` re-renders it from the results file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import trials  # noqa: E402

NAME = "diloco"
# task -> (DiLoCo config, its synchronous original, the metric)
TASKS = {
    "digits": ("configs/digits_cnn_diloco.py", "configs/digits_cnn.py", "accuracy"),
    "lm": ("configs/lm_tiny_diloco.py", "configs/lm_tiny.py", "loss"),
}


def load_config(path: str, inner_steps: int | None):
    spec = importlib.util.spec_from_file_location("config", os.path.join(trials.REPO_DIR, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    if inner_steps is None:
        config.diloco = None
    else:
        config.diloco.inner_steps = inner_steps
    return config


def train(path: str, inner_steps: int | None, workdir: str) -> dict:
    """The final eval record of one run through the command line (skipped if done)."""
    records = os.path.join(workdir, "metrics.jsonl")
    if not _final_eval(records):
        h = [f"--config.diloco.inner_steps={inner_steps}"] if inner_steps else []
        command = [
            sys.executable, "-m", "replicator", "train", "--config", path, *h,
            "--workdir", workdir, "--quiet",
        ]  # fmt: skip
        print("$", " ".join(command), flush=True)
        subprocess.run(command, cwd=trials.REPO_DIR, check=True)
    return _final_eval(records)


def _final_eval(records: str) -> dict | None:
    if not os.path.exists(records):
        return None
    with open(records) as f:
        evals = [r for r in map(json.loads, f) if r.get("split") == "test"]
    return evals[-1] if evals else None


def bytes_per_step(path: str, inner_steps: int | None) -> float:
    """Bytes each device sends between islands per step, from the compiled step's HLO."""
    from replicator.parallel import diloco as diloco
    from replicator.trainer.setup import setup

    run = setup(load_config(path, inner_steps))
    try:
        state = run.init_state()
        batch = run.repl.shard_batch(next(iter(run.train_iterator())))
        hlo = run.train_step.lower(state, batch).compile().as_text()
        sent = diloco.traffic(hlo, run.repl.mesh, "data")
        return sent["every_step"] + sent["in_branches"] / (inner_steps or 1)
    finally:
        run.close()


def measure(args) -> dict:
    result = {"machine": trials.machine(), "command": trials.command(), "jax": jax.__version__}
    for task, (path, original, metric) in TASKS.items():
        rows = []
        for h in [None, *args.h[task]]:
            name = "sync" if h is None else f"H={h}"
            workdir = os.path.join(args.workdir, f"{task}_{name}")
            final = train(original if h is None else path, h, workdir)
            sent = bytes_per_step(path, h)
            rows.append({"name": name, "inner_steps": h, metric: final[metric], "bytes": sent})
            print(task, rows[-1], flush=True)
        result[task] = {"config": path, "metric": metric, "rows": rows}
    return result


def render(result: dict) -> str:
    lines = [
        "## DiLoCo",
        "",
        "ReplicaGroups that meet every H steps vs synchronous data parallelism, on 4 islands of",
        "2 replicas (8 fake CPU devices; `benchmarks/diloco.py`, JAX "
        f"{result['jax']}). Bytes: what each device sends between islands per step,",
        "measured from the compiled train step's HLO (`rp.diloco.traffic`, ring model;",
        "the sync's collectives counted once per H steps); data parallelism's from its",
        "own step. Quality: the final test eval of one run, seed 0; `sync` is the",
        "synchronous original config (the same 8 replicas, the same inner optimizer).",
        "",
    ]
    for data in (result[t] for t in TASKS if t in result):
        metric, rows = data["metric"], data["rows"]
        sync = rows[0]["bytes"]
        lines += [
            f"`{data['config']}` (final test {metric}):",
            "",
            f"| | {metric} | bytes / step between islands | vs sync |",
            "|---|---|---|---|",
        ]
        for row in rows:
            lines.append(
                f"| {row['name']} | {row[metric]:.4g} | {row['bytes']:,.0f} | "
                f"{sync / row['bytes']:.1f}x fewer |"
                if row["inner_steps"]
                else f"| {row['name']} | {row[metric]:.4g} | {row['bytes']:,.0f} | 1x |"
            )
        lines.append("")
    lines.append(f"Command: `{result['command']}`")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--digits-h", default="5,20,50,100")
    parser.add_argument("--lm-h", default="5,10,30")
    parser.add_argument("--workdir", default="runs/diloco_bench")
    parser.add_argument("--docs-only", action="store_true")
    args = parser.parse_args()
    args.h = {
        "digits": [int(h) for h in args.digits_h.split(",") if h],
        "lm": [int(h) for h in args.lm_h.split(",") if h],
    }
    path = os.path.join(trials.RESULTS_DIR, f"{NAME}.json")
    if args.docs_only:
        with open(path) as f:
            result = json.load(f)
    else:
        result = measure(args)
        trials.write_result(NAME, result)
    print(render(result))


if __name__ == "__main__":
    main()
