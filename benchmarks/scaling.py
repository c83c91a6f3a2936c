"""Scaling: images/s of the tutorial CNN at 1, 2, 4 and 8 fake CPU devices, and 2 x 4.

Usage: .venv/bin/python benchmarks/scaling.py [--rounds 8] [--steps 3]

One worker process per device count and setting, all timed interleaved: the
replicator `compile` path with JAX's stock CPU settings, and with the CPU
settings proposed in ``benchmarks/cpu_defaults.py`` (malloc, Eigen
convolutions, max-pool lowering). Global batch 256 at every device count, so
this is strong scaling of one process over a 2-core machine: fake devices share
the same cores. Writes benchmarks/results/scaling.json and docs/scaling.png.

The "2 processes x 4 devices" rows run the same step on one global mesh of 8
devices spread over two local JAX processes (127.0.0.1, gloo collectives), each
feeding its own 128 rows of the batch. The pair takes part in the interleaving
as one worker: process 0 is the trials worker and starts process 1 itself, tells
it over a pipe how many steps to run for each trial, and ends the trial once its
own steps are done and process 1 has reported that its are.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import cnn_steps
import cpu_defaults
import trials

DEVICE_COUNTS = (1, 2, 4, 8)
SETTINGS = ("stock", "tuned")
PAIR = "2x4"  # 2 processes x 4 fake CPU devices: one mesh of 8 devices
PAIR_PROCESSES, PAIR_DEVICES = 2, 4
PATH = "replicator_compile"
PLOT = os.path.join(trials.REPO_DIR, "docs", "scaling.png")
_PAIR_TAG = "@@pair "  # process 1's answers to process 0 on its stdout


def build(tuned: bool) -> dict[str, trials.Candidate]:
    if tuned:
        cpu_defaults.apply_process_defaults()
    return cnn_steps.build(paths=[PATH])


# ------------------------------------------------------- 2 processes x 4 devices


def build_pair(tuned: bool, process_id: int = 0, port: int = 0, parent: int = 0) -> dict:
    """Worker entry point of the 2 x 4 row; run by the trials worker as process 0.

    Process 0 picks the coordinator port, starts process 1 (this same entry point
    with ``process_id=1``), joins the distributed run and returns its candidate,
    whose ``run(k)`` first tells process 1 to run k steps as well. Process 1
    never returns: it serves process 0's requests, then exits.
    """
    if process_id:
        _follow(tuned, process_id, port, parent)
    from replicator.runtime.launch import free_port_pair

    port = free_port_pair()
    spec = {"tuned": tuned, "process_id": 1, "port": port, "parent": os.getpid()}
    follower = subprocess.Popen(
        [sys.executable, os.path.join(trials.BENCH_DIR, "trials.py"), "scaling", "build_pair"]
        + [json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    finishing = threading.Event()
    threading.Thread(target=_watch, args=(follower, finishing), daemon=True).start()
    try:
        cand = _pair_candidate(tuned, 0, port)
    except BaseException:
        _kill(follower)
        _exit_now()  # JAX's shutdown barrier would wait minutes for process 1
    atexit.register(_finish_pair, follower, finishing)

    def run(k: int) -> Any:
        import jax

        follower.stdin.write(f"{k}\n")
        follower.stdin.flush()
        out = jax.block_until_ready(cand.run(k))
        if _read_answer(follower) != "done":
            raise RuntimeError(f"process 1 of the {PAIR} pair did not finish its {k} steps")
        return out

    return {PATH: trials.Candidate(run, cand.info)}


def _pair_candidate(tuned: bool, process_id: int, port: int) -> trials.Candidate:
    """Joins the pair, then builds this process's share of the 8-device step."""
    import jax

    from replicator.runtime.processes import ProcessGroup, initialize_distributed

    # Sets gloo CPU collectives; must come before anything starts JAX's backend.
    group = ProcessGroup(f"127.0.0.1:{port}", PAIR_PROCESSES, process_id, "explicit")
    initialize_distributed(group, timeout_s=300)
    if tuned:
        cpu_defaults.apply_process_defaults()
    devices = jax.devices()  # all 8, of both processes
    model = cnn_steps.make_model()
    host_batch = cnn_steps.synthetic_batch(cnn_steps.GLOBAL_BATCH)  # the same global batch
    rows = cnn_steps.GLOBAL_BATCH // PAIR_PROCESSES
    local = {k: v[process_id * rows : (process_id + 1) * rows] for k, v in host_batch.items()}
    params = jax.device_get(model.init(jax.random.key(0), host_batch["image"][:1])["params"])
    candidate = cnn_steps.replicator_candidate(model, local, params, devices, "replicator_compile")
    candidate.info.update(processes=PAIR_PROCESSES, rows_per_process=rows)
    return candidate


def _follow(tuned: bool, process_id: int, port: int, parent: int) -> None:
    """Process 1: runs k steps for every k process 0 sends, answers, exits on EOF."""
    _die_with_parent(parent)
    try:
        import jax

        cand = _pair_candidate(tuned, process_id, port)
        for line in sys.stdin:
            jax.block_until_ready(cand.run(int(line)))
            _answer("done")
        _answer("bye")
        jax.distributed.shutdown()  # the barrier process 0 meets in _finish_pair
    except BaseException:
        _exit_now()  # at once: process 0 is waiting in a collective or for an answer
    os._exit(0)


def _exit_now() -> None:
    """Prints the error being handled, if any, and exits at once, skipping JAX's shutdown
    barrier."""
    import traceback

    if sys.exc_info()[0] is not None:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _die_with_parent(parent: int) -> None:
    """Asks Linux to kill this process when process 0 dies, whatever the cause."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def _answer(word: str) -> None:
    sys.stdout.write(_PAIR_TAG + word + "\n")
    sys.stdout.flush()


def _read_answer(follower: subprocess.Popen) -> str | None:
    for line in follower.stdout:
        if line.startswith(_PAIR_TAG):
            return line[len(_PAIR_TAG) :].strip()
    return None  # process 1 is gone


def _watch(follower: subprocess.Popen, finishing: threading.Event) -> None:
    """Process 0 exits as soon as process 1 dies, instead of waiting in a collective
    until JAX's heartbeat timeout (about 100 s) aborts it."""
    code = follower.wait()
    if not finishing.is_set():
        print(f"scaling: process 1 of the {PAIR} pair exited with {code}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)


def _finish_pair(follower: subprocess.Popen, finishing: threading.Event) -> None:
    """At process 0's exit: lets process 1 leave, meets it at JAX's shutdown barrier."""
    import jax

    finishing.set()
    if follower.poll() is None:
        follower.stdin.close()
        if _read_answer(follower) == "bye":
            jax.distributed.shutdown()
            try:
                follower.wait(60)
                return
            except subprocess.TimeoutExpired:
                pass
    _kill(follower)
    # Process 1 is gone without the shutdown barrier; skip ours (it would wait minutes).
    _exit_now()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


# ------------------------------------------------------------------ coordinator


def _tuned_flags(setting: str, devices_per_process: int) -> str:
    return " " + cpu_defaults.xla_flags(devices_per_process) if setting == "tuned" else ""


def measure(rounds: int, steps: int) -> dict:
    specs = []
    for setting in SETTINGS:
        spec = {"tuned": setting == "tuned"}
        for n in DEVICE_COUNTS:
            flags = f"--xla_force_host_platform_device_count={n}" + _tuned_flags(setting, n)
            specs.append((f"{setting}/{n}", "scaling", "build", spec, {"XLA_FLAGS": flags}))
        flags = f"--xla_force_host_platform_device_count={PAIR_DEVICES}" + _tuned_flags(
            setting, PAIR_DEVICES
        )
        env = {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        specs.append((f"{setting}/{PAIR}", "scaling", "build_pair", spec, env))
    results, _ = trials.run_workers(specs, rounds, steps)
    rows = {}
    key = lambda setting, n: f"{setting}/{n}/{PATH}"
    for setting in SETTINGS:
        for n in (*DEVICE_COUNTS, PAIR):
            ips = [cnn_steps.GLOBAL_BATCH / t.wall_s for t in results if t.key == key(setting, n)]
            row = rows[f"{setting}/{n}"] = {
                **trials.time_stats(results, key(setting, n)),
                "images_per_s": trials.quartiles(ips),
                "vs_1_device": trials.ratio_stats(results, key(setting, n), key(setting, 1)),
                "vs_stock": trials.ratio_stats(results, key(setting, n), key("stock", n)),
            }
            if n == PAIR:
                row["vs_1_process"] = trials.ratio_stats(
                    results, key(setting, n), key(setting, max(DEVICE_COUNTS))
                )
    return {"rows": rows, "raw": [t.__dict__ for t in results]}


def plot(result: dict, path: str = PLOT) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def median_and_err(stats: list[dict]) -> tuple[list, list]:
        med = [s["median"] for s in stats]
        err = [[m - s["q1"] for m, s in zip(med, stats)], [s["q3"] - m for m, s in zip(med, stats)]]
        return med, err

    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    for setting, label in (("stock", "JAX stock CPU settings"), ("tuned", "proposed CPU defaults")):
        rows = result["rows"]
        med, err = median_and_err([rows[f"{setting}/{n}"]["images_per_s"] for n in DEVICE_COUNTS])
        line = ax.errorbar(DEVICE_COUNTS, med, yerr=err, marker="o", capsize=3, label=label)
        if f"{setting}/{PAIR}" in rows:
            med, err = median_and_err([rows[f"{setting}/{PAIR}"]["images_per_s"]])
            n = PAIR_PROCESSES * PAIR_DEVICES
            ax.errorbar(
                [n * 1.1], med, yerr=err, marker="*", markersize=11, capsize=3, linestyle="none",
                color=line[0].get_color(), label=f"{label}, 2 processes x 4",
            )  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(DEVICE_COUNTS, [str(n) for n in DEVICE_COUNTS])
    ax.set_xlabel("fake CPU devices (one process unless starred; 2 cores)")
    ax.set_ylabel("images/s (median, IQR)")
    ax.set_title("Tutorial CNN, global batch 256, Replicator.compile")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def render(result: dict) -> str:
    rows = result["rows"]
    pair = [key for key in rows if key.endswith(f"/{PAIR}")]
    lines = [
        "## Scaling",
        "",
        "Images/s of the tutorial CNN (global batch 256) under `Replicator.compile` at 1, "
        "2, 4 and 8 fake CPU devices in one process"
        + (", and at 8 devices in two processes of 4 (2 x 4)" if pair else "")
        + ", with JAX's stock CPU settings and with the proposed CPU defaults "
        f"(`benchmarks/cpu_defaults.py`). All {len(rows)} configurations ran interleaved, "
        "one worker process each"
        + (" (the 2 x 4 ones a pair)" if pair else "")
        + f", {result['rounds']} rounds x {result['steps']} steps. The devices share this "
        "machine's 2 cores, so this measures how well the cores are used, not more "
        "hardware. Ratios are per round, median [min-max].",
    ]
    if pair:
        lines += [
            "",
            "The 2 x 4 rows are one mesh of 8 devices over two local JAX processes "
            "(127.0.0.1, gloo CPU collectives), each feeding its own 128 rows of the batch "
            "(`Replicator.shard_batch`). Process 0 relays each trial's step count to process "
            "1 over a pipe and stops the clock when both have finished; its wall time per "
            'step is the figure. "vs 1 process" compares with 8 devices in one process.',
        ]
    lines += [
        "",
        "![scaling](scaling.png)",
        "",
        "| devices | setting | images/s (median) | ms/step | vs 1 device | vs stock "
        "| vs 1 process |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, row in rows.items():
        setting, n = key.split("/")
        devices = f"2 processes x {PAIR_DEVICES}" if n == PAIR else n
        vs_process = trials.fmt_ratio(row["vs_1_process"]) if "vs_1_process" in row else ""
        lines.append(
            f"| {devices} | {setting} | {row['images_per_s']['median']:,.0f} | "
            f"{trials.fmt_ms(row['wall_s']['median'])} | {trials.fmt_ratio(row['vs_1_device'])} | "
            f"{trials.fmt_ratio(row['vs_stock'])} | {vs_process} |"
        )
    if not pair:
        lines.append(
            "| 2 processes x 4 devices | | not measured in this run: rerun "
            "`benchmarks/scaling.py` | | | | |"
        )
    lines += [
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
