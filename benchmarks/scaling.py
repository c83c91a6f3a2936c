"""Scaling: images/s of the tutorial CNN at 1, 2, 4 and 8 fake CPU devices.

Usage: .venv/bin/python benchmarks/scaling.py [--rounds 8] [--steps 3]

One worker process per device count and setting, all timed interleaved: the
replicator `compile` path with JAX's stock CPU settings, and with the CPU
settings proposed in ``benchmarks/cpu_defaults.py`` (malloc, Eigen
convolutions, max-pool lowering). Global batch 256 at every device count, so
this is strong scaling of one process over a 2-core machine: fake devices share
the same cores. Writes benchmarks/results/scaling.json and docs/scaling.png.
"""

from __future__ import annotations

import os

import cnn_steps
import cpu_defaults
import trials

DEVICE_COUNTS = (1, 2, 4, 8)
SETTINGS = ("stock", "tuned")
PLOT = os.path.join(trials.REPO_DIR, "docs", "scaling.png")


def build(tuned: bool) -> dict[str, trials.Candidate]:
    if tuned:
        cpu_defaults.apply_process_defaults()
    return cnn_steps.build(paths=["replicator_compile"])


def measure(rounds: int, steps: int) -> dict:
    specs = []
    for setting in SETTINGS:
        for n in DEVICE_COUNTS:
            flags = f"--xla_force_host_platform_device_count={n}"
            if setting == "tuned":
                flags += " " + cpu_defaults.XLA_FLAGS
            spec = {"tuned": setting == "tuned"}
            specs.append((f"{setting}/{n}", "scaling", "build", spec, {"XLA_FLAGS": flags}))
    workers = trials.start_workers(specs)
    try:
        results = trials.run_trials(workers, rounds, steps)
    finally:
        for w in workers:
            w.close()
    rows = {}
    for setting in SETTINGS:
        for n in DEVICE_COUNTS:
            key = f"{setting}/{n}/replicator_compile"
            stats = trials.time_stats(results, key)
            ips = [cnn_steps.GLOBAL_BATCH / t.wall_s for t in results if t.key == key]
            rows[f"{setting}/{n}"] = {
                **stats,
                "images_per_s": trials.quartiles(ips),
                "vs_1_device": trials.ratio_stats(results, key, f"{setting}/1/replicator_compile"),
                "vs_stock": trials.ratio_stats(results, key, f"stock/{n}/replicator_compile"),
            }
    return {"rows": rows, "raw": [t.__dict__ for t in results]}


def plot(result: dict, path: str = PLOT) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    for setting, label in (("stock", "JAX stock CPU settings"), ("tuned", "proposed CPU defaults")):
        ips = [result["rows"][f"{setting}/{n}"]["images_per_s"] for n in DEVICE_COUNTS]
        med = [s["median"] for s in ips]
        err = [[m - s["q1"] for m, s in zip(med, ips)], [s["q3"] - m for m, s in zip(med, ips)]]
        ax.errorbar(DEVICE_COUNTS, med, yerr=err, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(DEVICE_COUNTS, [str(n) for n in DEVICE_COUNTS])
    ax.set_xlabel("fake CPU devices (one process, 2 cores)")
    ax.set_ylabel("images/s (median, IQR)")
    ax.set_title("Tutorial CNN, global batch 256, Replicator.compile")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def render(result: dict) -> str:
    lines = [
        "## Scaling",
        "",
        "Images/s of the tutorial CNN (global batch 256) under `Replicator.compile` at 1, "
        "2, 4 and 8 fake CPU devices in one process, with JAX's stock CPU settings and "
        "with the proposed CPU defaults (`benchmarks/cpu_defaults.py`). All eight "
        "configurations ran interleaved, one worker process each, "
        f"{result['rounds']} rounds x {result['steps']} steps. The devices share this "
        "machine's 2 cores, so this measures how well the cores are used, not more "
        "hardware. Ratios are per round, median [min-max].",
        "",
        "![scaling](scaling.png)",
        "",
        "| devices | setting | images/s (median) | ms/step | vs 1 device | vs stock |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in result["rows"].items():
        setting, n = key.split("/")
        lines.append(
            f"| {n} | {setting} | {row['images_per_s']['median']:,.0f} | "
            f"{trials.fmt_ms(row['wall_s']['median'])} | {trials.fmt_ratio(row['vs_1_device'])} | "
            f"{trials.fmt_ratio(row['vs_stock'])} |"
        )
    lines += [
        "| 2 processes x 4 devices | | TODO: not measured yet (the launcher exists now: "
        "`python -m replicator launch local`) | | | |",
        "",
        trials.machine_line(result),
        "",
        f"Command: `{result['command']}`",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    def add_plot(result):
        result["plot"] = os.path.relpath(plot(result), trials.REPO_DIR)

    trials.run_main(
        "scaling", __doc__, measure, [render], {"rounds": 8, "steps": 3}, finish=add_plot
    )


if __name__ == "__main__":
    main()
