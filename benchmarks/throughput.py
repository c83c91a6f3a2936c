"""Throughput and MFU of the tutorial CNN on this CPU, and what each CPU setting buys.

Usage: .venv/bin/python benchmarks/throughput.py [--rounds 10] [--steps 3]

MFU = model FLOPs per step (XLA's cost analysis of the 1-device compiled step)
/ step time / this machine's f32 matmul peak, measured in the same run (a
2048x2048x2048 matmul chain, best round). All candidates below run
interleaved in one run (one worker process per row group), so their ratios to
the stock JAX step are per round. The CPU settings are prototyped in
``benchmarks/cpu_defaults.py``:

* malloc: `cpu_defaults.keep_freed_memory` (glibc keeps freed memory);
* eigen conv: `cpu_defaults.COMPILER_OPTIONS` (convolutions on Eigen, not YNNPACK);
* pool lowering: `cpu_defaults.install_max_pool_lowering` (max pool and its
  gradient as strided slices + elementwise ops, no select_and_scatter);
* reshape pool: the model itself written with reshape + max (a model change,
  for reference only).

Writes benchmarks/results/throughput.json.
"""

from __future__ import annotations

import statistics

import cnn_steps
import cpu_defaults
import trials

MODEL = "tutorial CNN, 28x28x1, global batch 256, Adam, f32"
PEAK_SIZES = (1024, 2048)
PEAK_CHAIN = 4


def peak_candidate(n: int) -> trials.Candidate:
    """A chain of ``PEAK_CHAIN`` dependent f32 (n, n) x (n, n) matmuls per call.

    Each product feeds the next (``c = c @ b``), so XLA cannot hoist the matmul
    out of the loop; ``b`` is scaled by 1/sqrt(N) to keep the values finite.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((n, n), np.float32))
    b = jnp.asarray(rng.standard_normal((n, n), np.float32) / np.sqrt(n))

    @jax.jit
    def chain(a, b):
        return jax.lax.fori_loop(0, PEAK_CHAIN, lambda i, c: c @ b, a)

    def run(k):
        return [chain(a, b) for _ in range(k)][-1]

    return trials.Candidate(run, {"flops_per_call": 2 * n**3 * PEAK_CHAIN})


def build(candidates: list[dict], malloc: bool = False, pool_lowering: bool = False):
    """Worker entry: candidates built in order; process-wide settings first.

    A candidate may ask for ``pool_lowering``: it is installed just before that
    candidate is built, so candidates built earlier keep JAX's lowering.
    """
    if malloc:
        cpu_defaults.keep_freed_memory()
    if pool_lowering:
        cpu_defaults.install_max_pool_lowering()
    out = {}
    for c in candidates:
        if c.get("pool_lowering"):
            cpu_defaults.install_max_pool_lowering()
        if c["path"] == "peak":
            out[c["label"]] = peak_candidate(c["n"])
            continue
        options = cpu_defaults.COMPILER_OPTIONS if c.get("eigen_conv") else None
        pool = c.get("pool", "flax")
        built = cnn_steps.build(paths=[c["path"]], pool=pool, compiler_options=options)
        out[c["label"]] = built[c["path"]]
    return out


def _devices_env(n: int, tuned: bool, scheduler: bool = False) -> dict[str, str]:
    flags = [f"--xla_force_host_platform_device_count={n}"]
    if tuned:
        flags.append(cpu_defaults.XLA_FLAGS)
    if scheduler:
        flags.append(cpu_defaults.SEVERAL_DEVICES_XLA_FLAGS)
    return {"XLA_FLAGS": " ".join(flags)}


# (worker, env, malloc, pool_lowering, launcher, candidates); labels are "worker/label".
def worker_specs() -> list[tuple]:
    jit = lambda label, **kw: {"label": label, "path": "jit", **kw}
    tuned = dict(malloc=True, pool_lowering=True)
    return [
        ("stock", _devices_env(1, False), {}, (), [
            *({"label": f"peak {n}", "path": "peak", "n": n} for n in PEAK_SIZES),
            jit("jax defaults"),
            jit("eigen conv", eigen_conv=True),
        ]),
        ("malloc", _devices_env(1, False), {"malloc": True}, (), [
            jit("malloc"),
            jit("malloc + eigen conv", eigen_conv=True),
            jit("malloc + eigen conv + reshape pool (model change)", eigen_conv=True,
                pool="reshape"),
            jit("malloc + pool lowering", pool_lowering=True),  # installed from here on
            jit("malloc + eigen conv + pool lowering", eigen_conv=True),
        ]),
        ("pool", _devices_env(1, False), {"pool_lowering": True}, (), [
            jit("pool lowering"),
            jit("eigen conv + pool lowering", eigen_conv=True),
        ]),
        ("tuned1", _devices_env(1, True), tuned, (), [
            jit("all three, 1 device"),
            {"label": "replicator compile, all three, 1 device", "path": "replicator_compile"},
        ]),
        ("tuned1core", _devices_env(1, True), tuned, ("taskset", "-c", "0"), [
            jit("all three, 1 device, pinned to 1 core"),
        ]),
        ("tuned2", _devices_env(2, True), tuned, (), [
            jit("all three, 2 devices"),
            {"label": "replicator compile, all three, 2 devices", "path": "replicator_compile"},
        ]),
        # What malloc and the scheduler each do on 2 devices; then replicator's defaults.
        ("pool2", _devices_env(2, True), {"pool_lowering": True}, (), [
            jit(TWO_NO_MALLOC),
        ]),
        ("sched2", _devices_env(2, True, scheduler=True), {"pool_lowering": True}, (), [
            jit(TWO_SCHED_NO_MALLOC),
        ]),
        ("ours2", _devices_env(2, True, scheduler=True), tuned, (), [
            jit(TWO_SCHED),
            {"label": OURS_SCHED, "path": "replicator_compile"},
        ]),
        ("stock8", _devices_env(8, False), {}, (), [jit("jax defaults, 8 devices")]),
    ]  # fmt: skip


ALL = "malloc/malloc + eigen conv + pool lowering"
TWO_NO_MALLOC = "eigen conv + pool lowering, 2 devices"
TWO_SCHED_NO_MALLOC = "eigen conv + pool lowering + memory-optimized scheduler, 2 devices"
TWO_SCHED = "all three + memory-optimized scheduler, 2 devices"
OURS_SCHED = "replicator compile, replicator's CPU defaults, 2 devices"
# factor -> (the factor alone, every factor but this one); compared with stock / with ALL.
FACTORS = {
    "pool lowering": ("pool/pool lowering", "malloc/malloc + eigen conv"),
    "eigen conv": ("stock/eigen conv", "malloc/malloc + pool lowering"),
    "malloc": ("malloc/malloc", "pool/eigen conv + pool lowering"),
}


def measure(rounds: int, steps: int) -> dict:
    specs = [
        (name, "throughput", "build", {"candidates": cands, **flags}, env, launcher)
        for name, env, flags, launcher, cands in worker_specs()
    ]
    results, info = trials.run_workers(specs, rounds, steps)
    peak_keys = [f"stock/peak {n}" for n in PEAK_SIZES]
    peak_rates = {
        key: [info[key]["flops_per_call"] / t.wall_s for t in results if t.key == key]
        for key in peak_keys
    }
    peak = max(max(rates) for rates in peak_rates.values())
    model_flops = info["stock/jax defaults"]["flops_per_device"]  # 1 device: the whole step
    base = "stock/jax defaults"
    rows = {}
    for key in info:
        if key in peak_keys:
            continue
        stats = trials.time_stats(results, key)
        wall, best = stats["wall_s"]["median"], stats["wall_s"]["min"]
        rows[key] = {
            **stats,
            "images_per_s": cnn_steps.GLOBAL_BATCH / wall,
            "mfu": model_flops / wall / peak,
            "mfu_best_round": model_flops / best / peak,
            "speedup": trials.ratio_stats(results, key, base),
            "temp_bytes": info[key].get("temp_bytes"),
        }
    factors = {
        name: {
            "alone": trials.ratio_stats(results, alone, base),
            "on_top_of_the_others": trials.ratio_stats(results, ALL, without),
        }
        for name, (alone, without) in FACTORS.items()
    }
    one, two = "tuned1/all three, 1 device", "tuned2/all three, 2 devices"
    devices = {
        "two_cores_vs_one_core_1_device": trials.ratio_stats(
            results, one, "tuned1core/all three, 1 device, pinned to 1 core"
        ),
        "two_devices_vs_one_device": trials.ratio_stats(results, two, one),
        "malloc_2_devices": trials.ratio_stats(results, two, f"pool2/{TWO_NO_MALLOC}"),
        "scheduler_2_devices": trials.ratio_stats(
            results, f"sched2/{TWO_SCHED_NO_MALLOC}", f"pool2/{TWO_NO_MALLOC}"
        ),
        "scheduler_with_malloc_2_devices": trials.ratio_stats(results, f"ours2/{TWO_SCHED}", two),
    }
    return {
        "factors": factors,
        "device_split": devices,
        "model": MODEL,
        "model_flops_per_step": model_flops,
        "peak_flops_per_s": peak,
        "peak_flops_per_s_median": {k: statistics.median(v) for k, v in peak_rates.items()},
        "rows": rows,
        "raw": [t.__dict__ for t in results],
    }


def render(result: dict) -> str:
    peak = result["peak_flops_per_s"] / 1e9
    medians = ", ".join(f"{v / 1e9:.0f}" for v in result["peak_flops_per_s_median"].values())
    lines = [
        "## Throughput and MFU on CPU",
        "",
        f"{result['model']}: {result['model_flops_per_step'] / 1e9:.2f} GFLOP per step "
        "(XLA cost analysis of the 1-device compiled step). Peak: chains of dependent f32 "
        f"square matmuls (n = {', '.join(map(str, PEAK_SIZES))}) measured in the same run, "
        f"best round {peak:.0f} GFLOP/s (median rounds: {medians} GFLOP/s). MFU uses the median "
        "step time (and, in brackets, the best round's). Speed-up is per round against "
        "stock JAX on 1 device, median [min-max]. Everything ran interleaved in one run "
        f"of {result['rounds']} rounds x {result['steps']} steps.",
        "",
        "| configuration | ms/step (median) | images/s | MFU | CPU ms/step | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in result["rows"].items():
        label = key.split("/", 1)[1]
        lines.append(
            f"| {label} | {trials.fmt_ms(row['wall_s']['median'])} | "
            f"{row['images_per_s']:,.0f} | {100 * row['mfu']:.0f}% "
            f"({100 * row['mfu_best_round']:.0f}%) | {trials.fmt_ms(row['cpu_s']['median'])} | "
            f"{trials.fmt_ratio(row['speedup'])} |"
        )
    lines += [
        "",
        "Settings (prototyped in `benchmarks/cpu_defaults.py`): *malloc* = glibc keeps "
        "freed memory (`mallopt(M_MMAP_MAX, 0)`, `M_TRIM_THRESHOLD` max); *eigen conv* = "
        "`compiler_options={'xla_cpu_experimental_ynn_fusion_type': "
        "'LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT'}` (convolutions on Eigen, dots on "
        "YNNPACK); *pool lowering* = non-overlapping max pool and its gradient lowered to "
        "strided slices and elementwise ops instead of reduce-window / select-and-scatter; "
        "*all three* = the three together (the compiler option through `XLA_FLAGS`, so "
        "replicator's own jit picks it up). No row changes the model code except *reshape "
        "pool*, kept as a reference.",
        "",
        trials.machine_line(result),
        "",
        f"Command: `{result['command']}`",
        "",
    ]
    return "\n".join(lines)


def render_findings(result: dict) -> str:
    """The analysis: why stock JAX is slow on this CPU and what replicator should do."""
    rows = {key.split("/", 1)[1]: row for key, row in result["rows"].items()}
    x = lambda label: f"{rows[label]['speedup']['median']:.1f}x"
    f = result["factors"]
    gain = lambda name: (
        f"{f[name]['alone']['median']:.1f}x alone, "
        f"{f[name]['on_top_of_the_others']['median']:.1f}x on top of the other two"
    )
    split = result["device_split"]
    per_image = result["model_flops_per_step"] / cnn_steps.GLOBAL_BATCH
    tf_mfu = "-".join(
        f"{100 * rate * per_image / result['peak_flops_per_s']:.0f}%" for rate in (6500, 8700)
    )
    ips = lambda label: f"{rows[label]['images_per_s']:,.0f}"
    mfu = lambda label: f"{100 * rows[label]['mfu']:.0f}%"
    return "\n".join(
        [
            "## CPU speed: findings and proposed defaults",
            "",
            "Why stock JAX trains the tutorial CNN slowly on this CPU, each cause measured "
            "alone and as the last one added, from the table above (medians of per-round "
            "ratios, same run):",
            "",
            "1. **Max-pool backward** (" + gain("pool lowering") + "). XLA:CPU "
            "expands `select_and_scatter` (the gradient of `nn.max_pool`) into four "
            "full-size int32 iotas, a variadic reduce-window computing an argmax, and a "
            "scatter: 40-50% of the stock step in `benchmarks/profile_step.py`. For "
            "non-overlapping windows (window == stride, no padding: every pool of the "
            "tutorial CNN) the same gradient is a few elementwise ops on strided slices: "
            "route the cotangent to the first maximum of each window (XLA's own "
            "tie-breaking; results are bitwise identical, ties included). The forward "
            "`reduce_window` is lowered the same way so XLA fuses bias + relu + pool into "
            "one pass and the backward recomputes instead of storing the relu output.",
            "2. **Convolutions on YNNPACK** (" + gain("eigen conv") + "). This "
            "jaxlib sends convolutions to YNNPACK by default; for these shapes Eigen is "
            "1.6-3.6x faster per convolution (`benchmarks/profile_step.py --convs`). "
            "`--xla_cpu_use_xnnpack` and `--xla_cpu_use_onednn` do not change the compiled "
            "program at all in jaxlib 0.10.2 (checked on the HLO), which is why the first "
            "profile found no XLA flag that helped; the switch is "
            "`xla_cpu_experimental_ynn_fusion_type`, which also works per `jax.jit` as a "
            "compiler option.",
            "3. **Page faults on every step** (" + gain("malloc") + "). XLA:CPU "
            "allocates one temp buffer per execution "
            "(229 MB for the stock step, ~60 MB after 1 and 2). glibc serves blocks over "
            "32 MB with `mmap` and returns them with `munmap`, so every step faults its "
            "working set in again; this VM's free-page reporting makes that dearer.",
            "4. **One device does not use both cores**: with all three settings, 1 device "
            "on 2 cores is only "
            f"{split['two_cores_vs_one_core_1_device']['median']:.2f}x faster than the same "
            "process pinned to one core, while 2 devices are "
            f"{split['two_devices_vs_one_device']['median']:.2f}x faster than 1. Most "
            "of XLA:CPU's small ops and fusions run on one thread; one device per core "
            "runs the data-parallel halves side by side. More devices than cores is "
            "slower again (see Scaling).",
            "5. **Several devices in one process contend for memory** (on 2 devices: the "
            f"malloc setting {trials.fmt_ratio(split['malloc_2_devices'])}; XLA's "
            "memory-optimized scheduler "
            f"{trials.fmt_ratio(split['scheduler_2_devices'])} without it, "
            f"{trials.fmt_ratio(split['scheduler_with_malloc_2_devices'])} on top of it). "
            "Each device's step allocates and frees its temp buffers every step, side by "
            "side with the other devices': with glibc's defaults every step maps fresh "
            "pages and the threads queue on the kernel's memory-map lock. XLA:CPU's "
            "default scheduler also puts the per-step metric all-reduce in the middle of "
            "the backward pass (the first layer's bias + relu + pool fusion took 5.4 ms "
            "instead of 1.4 in a profile). "
            "`xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED` reorders the "
            "step, with bitwise identical results; on 1 device both are neutral to "
            "slightly slower (0.9-1.0x). `benchmarks/conv_study.py` found the scheduler while "
            "looking for a faster formulation of the convolutions: none of im2col, nine "
            "shifted matmuls, `conv_general_dilated_patches` or NCHW beats Eigen's "
            "convolutions in the whole step (0.4-0.9x); the second convolution already "
            "runs at about the measured matmul rate.",
            "",
            f"Together, with the model code unchanged: {ips(TWO_SCHED)} images/s, "
            f"{mfu(TWO_SCHED)} MFU, {x(TWO_SCHED)} the stock 1-device step; "
            f"`Replicator.compile` with replicator's CPU defaults on 2 devices: "
            f"{ips(OURS_SCHED)} images/s, {mfu(OURS_SCHED)} MFU. The goal of 45% "
            "MFU is not reached: after these fixes the step is "
            "dominated by memory-bound work XLA:CPU does not fuse away (transposes of the "
            "activations that Eigen's weight-gradient convolutions need, "
            "bias/relu/pool masks over the 22 MB first-layer activation, bias-gradient "
            "reductions), not by the matmul units. The issue's TensorFlow figure "
            f"(6,500-8,700 images/s, MirroredStrategy with oneDNN, 1 device) is {tf_mfu} "
            "of the peak measured here.",
            "",
            "**What replicator does on CPU hosts** (`replicator/spmd/cpu.py`):",
            "",
            "- Max-pool lowering: adopted. A `Replicator` built on CPU devices installs it "
            "once per process (CPU-only lowering rules for `reduce_window_max` and "
            "`select_and_scatter_add`; other windows keep JAX's); `cpu_defaults=False` opts out.",
            "- Eigen convolutions: adopted. On CPU meshes both `jax.jit` calls (`run`, "
            "`compile`) get `compiler_options={'xla_cpu_experimental_ynn_fusion_type': "
            "'LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT'}`.",
            "- Where a process holds several CPU devices: the malloc setting "
            "(`cpu.keep_freed_memory`, process-wide: the process keeps its peak heap, "
            "which a training loop reaches every step anyway). Not for a single device, "
            "where it does not pay. The memory-optimized scheduler was a default too, until "
            "it crashed or deadlocked XLA:CPU on programs with collectives over two mesh "
            "axes (an MoE step reducing over `data` and `expert`, 2026-11-26); on top of "
            "the malloc setting it had measured 1.05 [0.65-1.27].",
            "- One device per core: not made the default. It pays at batch 256 (1.8x), but "
            "the offline default (digits, batch 64) trains slower on 2 devices than on 1 "
            "(12.8 s vs 10.4 s); use `--cpu_devices=N` where the per-device batch is large.",
            "",
        ]
    )


def main() -> None:
    trials.run_main(
        "throughput", __doc__, measure, [render, render_findings], {"rounds": 10, "steps": 3}
    )


if __name__ == "__main__":
    main()
