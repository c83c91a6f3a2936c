"""The seed's GAN claim in miniature: bigger global batches, better samples, same steps.

Usage: .venv/bin/python benchmarks/gan_sweep.py [--batch-sizes 16,32,64,128,256]
       [--steps 2000] [--seeds 1] [--workdir runs/gan_sweep] [--cpu-devices 8]
       [--docs-only]

TF-Replicator (Buchlovsky et al., 2019) trained SN-GANs with global batches
spread over many TPU cores and found sample quality (Inception score, FID)
improving with the batch size. This script trains `configs/gan_digits.py`
through the trainer's command line, once per batch size and seed, with the
same number of steps and learning rates at every batch size:

    python -m replicator train --config configs/gan_digits.py \\
        --config.batch_size=B --config.num_train_steps=S --config.seed=K --workdir ...

and reads the final eval record (``fid``, ``classifier_score``: see
``experiments/gan/score.py``) and the summary record (wall time, examples/s)
of each run from its ``metrics.jsonl``. A run whose final eval is already in
its workdir is not repeated; an interrupted one resumes from its checkpoint.
For scale, the same scores of 360 real training scans against the test split
are computed here too.

Writes benchmarks/results/gan_sweep.json, docs/gan_sweep.png, and prints the
``## GAN batch-size sweep`` section of docs/benchmarks.md (`render`). On CPU the
runs use ``--cpu-devices`` fake devices (0: leave XLA_FLAGS alone). About 20
minutes per seed on a 2-core CPU with 8 fake devices (batch 256 takes half).
``--docs-only`` re-renders from the results file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import trials

NAME = "gan_sweep"
CONFIG = "configs/gan_digits.py"
PLOT = os.path.join(trials.REPO_DIR, "docs", f"{NAME}.png")
METRICS = ("fid", "classifier_score")
START_FILE = "sweep_start.json"  # in each run's workdir: the load average when it started


def run_training(batch_size: int, steps: int, seed: int, workdir: str, cpu_devices: int) -> None:
    """One training run through the trainer's command line (it resumes if interrupted)."""
    command = [
        sys.executable, "-m", "replicator", "train", "--config", CONFIG,
        f"--config.batch_size={batch_size}", f"--config.num_train_steps={steps}",
        f"--config.seed={seed}", "--workdir", workdir,
    ]  # fmt: skip
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if cpu_devices and "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
    print("$", " ".join(command), flush=True)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, START_FILE), "w") as f:  # the machine may be shared
        json.dump({"load_average": os.getloadavg()[0]}, f)
    subprocess.run(command, check=True, cwd=trials.REPO_DIR, env=env)


def read_run(workdir: str, steps: int) -> dict[str, Any] | None:
    """The final eval scores and the summary of a finished run, or None if it has none."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    evals = [r for r in records if "fid" in r and r.get("step") == steps and not r.get("sidecar")]
    summaries = [r for r in records if r.get("split") == "summary"]
    if not evals:
        return None
    summary = summaries[-1] if summaries else {}
    start = {}
    if os.path.exists(os.path.join(workdir, START_FILE)):
        with open(os.path.join(workdir, START_FILE)) as f:
            start = json.load(f)
    wall_time = summary.get("wall_time_s")
    if isinstance(wall_time, dict):  # the trainer's breakdown: setup, compile, compute, ...
        wall_time = wall_time.get("total")
    return {
        **{name: float(evals[-1][name]) for name in METRICS},
        "wall_time_s": wall_time,
        "examples_per_sec": summary.get("examples_per_sec"),
        "load_average_at_start": start.get("load_average"),
    }


def real_data_scores(draws: int = 5) -> dict[str, dict[str, float]]:
    """The scores of 360 real training scans against the test split, over random draws.

    Real scans are the ceiling a generator aims at; with 360 samples the
    Fréchet distance itself varies from draw to draw, hence the spread.
    """
    sys.path.insert(0, trials.REPO_DIR)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a few small matrices
    from experiments.gan.score import (
        fit_digits_classifier,
        load_digits_split,
        score_sums,
        summarize_scores,
        to_unit_range,
    )

    train, _ = load_digits_split("train")
    test, _ = load_digits_split("test")
    scores = []
    for draw in range(draws):
        rows = np.random.default_rng(draw).permutation(len(train))[: len(test)]
        sums = score_sums(
            fit_digits_classifier(), to_unit_range(train[rows]), to_unit_range(test),
            np.ones(len(test)),
        )  # fmt: skip
        scores.append(summarize_scores(sums))
    return {name: _spread([s[name] for s in scores]) for name in METRICS}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": float(np.median(values)), "min": min(values), "max": max(values)}


def measure(batch_sizes: list[int], steps: int, seeds: int, workdir: str, cpu_devices: int):
    """Trains what is missing and collects every run's final scores."""
    runs = []
    for batch_size in batch_sizes:
        for seed in range(seeds):
            run_dir = os.path.abspath(os.path.join(workdir, f"batch_{batch_size}_seed_{seed}"))
            if read_run(run_dir, steps) is None:
                run_training(batch_size, steps, seed, run_dir, cpu_devices)
            result = read_run(run_dir, steps)
            if result is None:
                raise RuntimeError(f"{run_dir}: no eval record at step {steps} after training.")
            runs.append({"batch_size": batch_size, "seed": seed, **result})
            print(json.dumps(runs[-1]), flush=True)
    draws = 5
    return {
        "runs": runs,
        "real_data": real_data_scores(draws),
        "real_data_draws": draws,
        "devices": describe_devices(cpu_devices),
    }


def describe_devices(cpu_devices: int) -> str:
    """What the runs trained on, in words (the trainer takes every local device)."""
    probe = "import jax; d = jax.devices(); print(jax.default_backend(), len(d), d[0].device_kind)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    backend, count, kind = out.stdout.split(maxsplit=2)
    if backend == "cpu":
        return f"{cpu_devices or count} CPU devices"
    return f"{count} x {kind.strip()}"


def per_batch_size(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Runs grouped by batch size: each metric's median, min and max over seeds."""
    grouped: dict[int, list[dict]] = {}
    for run in result["runs"]:
        grouped.setdefault(run["batch_size"], []).append(run)
    table = {}
    for batch_size, runs in sorted(grouped.items()):
        row = {"seeds": len(runs)}
        for key in (*METRICS, "wall_time_s", "examples_per_sec"):
            values = [r[key] for r in runs if r.get(key) is not None]
            if values:
                row[key] = _spread(values)
        table[batch_size] = row
    return table


def render(result: dict[str, Any]) -> str:
    """The ``## GAN batch-size sweep`` section of docs/benchmarks.md."""

    def cell(stats: dict | None, digits: int) -> str:
        if stats is None:
            return "-"
        text = f"{stats['median']:.{digits}f}"
        if stats["min"] != stats["max"]:
            text += f" [{stats['min']:.{digits}f}-{stats['max']:.{digits}f}]"
        return text

    table = per_batch_size(result)
    seeds = max(row["seeds"] for row in table.values())
    rows = [
        f"| {b} | {b * result['steps']:,} | {cell(row.get('fid'), 2)} | "
        f"{cell(row.get('classifier_score'), 2)} | {cell(row.get('wall_time_s'), 0)} | "
        f"{cell(row.get('examples_per_sec'), 0)} |"
        for b, row in table.items()
    ]
    real = result["real_data"]
    spread = f"median [min-max] over {seeds} seeds" if seeds > 1 else "seed 0"
    return "\n".join(
        [
            "## GAN batch-size sweep",
            "",
            "TF-Replicator's claim that an SN-GAN's samples improve with the global batch, "
            f"in miniature: `{CONFIG}` (hinge loss, spectral norm, cross-replica BatchNorm, "
            f"two RMSProp optimizers in one step) for {result['steps']} steps at every batch "
            f"size, learning rates unchanged, on {result['devices']}, {spread}. Scores of one "
            "sample "
            "per test scan (360) by a small digits classifier: `fid` is the Fréchet distance "
            "in its 64 hidden features (lower is better), `classifier_score` its Inception "
            "score (1-10, higher is better). For scale, 360 real training scans score "
            f"fid {cell(real['fid'], 2)} and classifier_score "
            f"{cell(real['classifier_score'], 2)} (median [min-max] over "
            f"{result['real_data_draws']} random draws). Equal steps mean that a bigger batch "
            "also sees more examples, as in the seed's comparison. "
            f"Command: `{result['command']}`.",
            "",
            "| global batch | examples seen | fid | classifier_score | wall time (s) | "
            "examples/s |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"![fid and classifier score per batch size]({os.path.basename(PLOT)})",
            "",
            machine_line(result),
            "",
        ]
    )


def machine_line(result: dict[str, Any]) -> str:
    """The machine, and how busy it was when the runs started (if they recorded it)."""
    machine = result["machine"]
    loads = [r["load_average_at_start"] for r in result["runs"] if r.get("load_average_at_start")]
    busy = f"; load average {min(loads):.1f}-{max(loads):.1f} at the runs' starts" if loads else ""
    return f"Machine: {machine['cpu']}, {machine['cores']} cores, shared{busy}."


def plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = per_batch_size(result)
    sizes = list(table)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), constrained_layout=True)
    for ax, metric, better in zip(axes, METRICS, ("lower", "higher")):
        stats = [table[b].get(metric) for b in sizes]
        median = np.array([s["median"] for s in stats])
        low = median - np.array([s["min"] for s in stats])
        high = np.array([s["max"] for s in stats]) - median
        ax.errorbar(sizes, median, yerr=[low, high], marker="o", capsize=3, label="GAN samples")
        real = result["real_data"][metric]
        ax.axhline(real["median"], color="gray", ls="--", label="360 real scans")
        ax.axhspan(real["min"], real["max"], color="gray", alpha=0.15, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("global batch size")
        ax.set_title(f"{metric} ({better} is better)")
        ax.legend(fontsize=8)
    fig.suptitle(f"configs/gan_digits.py, {result['steps']} steps at every batch size")
    fig.savefig(PLOT, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="16,32,64,128,256")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--workdir", default=os.path.join(trials.REPO_DIR, "runs", NAME))
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--docs-only", action="store_true", help="render the results file")
    args = parser.parse_args()
    path = os.path.join(trials.RESULTS_DIR, f"{NAME}.json")
    if args.docs_only:
        with open(path) as f:
            result = json.load(f)
    else:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        result = {
            "command": trials.command(),
            "machine": trials.machine(),
            "batch_sizes": batch_sizes,
            "steps": args.steps,
            "seeds": args.seeds,
            "cpu_devices": args.cpu_devices,
            **measure(batch_sizes, args.steps, args.seeds, args.workdir, args.cpu_devices),
        }
        path = trials.write_result(NAME, result)
    plot(result)
    print(render(result))
    print(f"wrote {os.path.relpath(path, trials.REPO_DIR)} and "
          f"{os.path.relpath(PLOT, trials.REPO_DIR)}")  # fmt: skip


if __name__ == "__main__":
    main()
