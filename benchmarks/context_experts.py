"""Context and expert parallelism (issue 35): memory per device, TPU fit, MoE speed.

Usage: .venv/bin/python benchmarks/context_experts.py [--only memory,tpu,moe] [--no-tpu]
       [--rounds N] [--docs-only]

Three measurements, each in a process of its own, all through the trainer's own
`setup` (`replicator.trainer.setup`: the config's mesh, rules, remat and steps) and
the global view (``step_path='compile'``, where a ``context`` axis splits the
sequence between layers):

* ``memory``: the LM train step of ``configs/lm_tiny.py`` (2 layers, width 128, 4
  heads, vocabulary 256, float32) compiled for 8 CPU devices from abstract inputs,
  sequence lengths 512 to 4,096: ``compiled.memory_analysis()``'s temporaries and
  arguments per device, on ``data=8`` against ``data=2, context=4`` and
  ``context=8`` (gather and ring) at a global batch of 8 sequences, and
  ``context=8`` at one sequence.
* ``tpu``: ``configs/lm_1b.py`` (remat ``full``) compiled by libtpu for a v5e-16
  (16 chips of 15.75 GiB; nothing runs), train step only, per-chip total bytes
  (`replicator.trainer.aot`'s formula) at sequence lengths 32k and 64k, with and
  without a ``context`` axis. Needs libtpu (``--no-tpu`` skips it).
* ``moe``: a 4-layer LM of width 128 whose every second MLP is a mixture of 8
  experts (2 per token, capacity factor 1.25) against the dense LM with the same
  active parameters per token, trained on 8 CPU devices: tokens per second from
  interleaved trials (`trials.py`'s workers) and the all-to-all bytes per device
  per step (`replicator.compiled.hlo.analyze`).

The windows are zeros of the right length (this module's ``tokens_<N>`` datasets,
``dataset='context_experts:tokens_<N>'``): compiling needs only their shape.
Writes benchmarks/results/context_experts.json and, through `render`, the
"Context and expert parallelism" section of docs/benchmarks.md. About 10 minutes
on the 2-core machine, most of it the libtpu compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import trials

RESULT = os.path.join(trials.RESULTS_DIR, "context_experts.json")
LENGTHS = (512, 1024, 2048, 4096)
# label -> (mesh, global batch, context_strategy)
CPU_MESHES = {
    "data=8": ({"data": 8}, 8, "gather"),
    "data=2 context=4, gather": ({"data": 2, "context": 4}, 8, "gather"),
    "context=8, gather": ({"context": 8}, 8, "gather"),
    "context=8, ring": ({"context": 8}, 8, "ring"),
    "context=8, gather, 1 sequence": ({"context": 8}, 1, "gather"),
    "context=8, ring, 1 sequence": ({"context": 8}, 1, "ring"),
}
TOPOLOGY = "v5e-16"
K = 1024
# (label, mesh, global batch, context_strategy, sequence length)
TPU_CASES = (
    ("fsdp=16", {"fsdp": 16}, 16, "gather", 32 * K),
    ("fsdp=16", {"fsdp": 16}, 16, "gather", 64 * K),
    ("fsdp=2 context=8, gather", {"fsdp": 2, "context": 8}, 2, "gather", 64 * K),
    ("fsdp=2 context=8, ring", {"fsdp": 2, "context": 8}, 2, "ring", 64 * K),
    ("fsdp=2 context=8, ring", {"fsdp": 2, "context": 8}, 2, "ring", 128 * K),
    ("fsdp=2 context=8, ring", {"fsdp": 2, "context": 8}, 2, "ring", 256 * K),
)
MOE_LEN, MOE_BATCH, EXPERT_MLP = 256, 32, 256
MOE_MODEL = dict(
    num_layers=4, embed_dim=128, num_heads=4, mlp_dim=EXPERT_MLP, num_experts=8,
    experts_per_token=2, expert_capacity_factor=1.25, moe_every=2,
)  # fmt: skip
# Same active MLP parameters per token: per group of moe_every blocks, (every - 1)
# dense MLPs and k experts of EXPERT_MLP, as moe_every dense MLPs of this width.
DENSE_MLP = EXPERT_MLP * (MOE_MODEL["moe_every"] - 1 + MOE_MODEL["experts_per_token"]) // 2
MOE_CANDIDATES = {
    "MoE, expert=8": ({"expert": 8}, MOE_MODEL),
    "MoE, expert=4 data=2": ({"expert": 4, "data": 2}, MOE_MODEL),
    "MoE, data=8 (experts replicated)": ({"data": 8}, MOE_MODEL),
    "dense, data=8": ({"data": 8}, dict(num_layers=4, embed_dim=128, num_heads=4,
                                        mlp_dim=DENSE_MLP)),
}  # fmt: skip


def __getattr__(name: str):
    """``tokens_<N>``: a data function of windows of N + 1 zero tokens (compiles read
    one example's shape), for ``dataset='context_experts:tokens_<N>'``."""
    match = re.fullmatch(r"tokens_(\d+)", name)
    if match is None:
        raise AttributeError(name)
    length = int(match.group(1)) + 1
    return lambda split: [{"tokens": np.zeros(length, np.int32)} for _ in range(2)]


def lm_config(path: str, *, max_len: int, mesh: dict, batch: int, strategy: str, model=None):
    """``path``'s config for windows of ``max_len`` on ``mesh``, global view."""
    from replicator.trainer.config_files import read_config_file

    config = read_config_file(os.path.join(trials.REPO_DIR, path))
    with config.unlocked():
        config.model.update(max_len=max_len, **(model or {}))
    config.dataset = f"context_experts:tokens_{max_len}"
    config.mesh = mesh
    config.batch_size = config.eval_batch_size = batch
    config.context_strategy = strategy
    config.step_path = "compile"
    config.remat_policy, config.grad_accum_steps = "full", 1  # the tables' program
    return config


def lower_train(run):
    """The run's train step lowered from abstract state and batch (nothing allocated)."""
    from replicator.trainer import aot

    state = aot.abstract_state(run)
    batch, _ = aot.abstract_batches(run)
    return run.train_step.lower(state, batch), state


# ---------------------------------------------------------------- children


def child_memory() -> list[dict]:
    """Part 1, in a process with 8 CPU devices."""
    from replicator.trainer import aot
    from replicator.trainer.setup import setup

    rows = []
    for length in LENGTHS:
        for label, (mesh, batch, strategy) in CPU_MESHES.items():
            config = lm_config(
                "configs/lm_tiny.py", max_len=length, mesh=mesh, batch=batch, strategy=strategy
            )
            run = setup(config)
            try:
                start = time.perf_counter()
                memory = aot.memory_fields(lower_train(run)[0].compile().memory_analysis())
            finally:
                run.close()
            rows.append(dict(label=label, mesh=mesh, batch=batch, strategy=strategy,
                             length=length, memory=memory,
                             compile_s=time.perf_counter() - start))  # fmt: skip
            print(label, length, memory["temp_size_in_bytes"], file=sys.stderr, flush=True)
    return rows


def child_tpu() -> list[dict]:
    """Part 2: lm_1b's train step compiled by libtpu for a v5e-16."""
    import dataclasses

    from replicator.compiled import topology as topology
    from replicator.trainer import aot
    from replicator.trainer.setup import setup

    spec = topology.accelerator(TOPOLOGY)
    topology.check_libtpu()
    devices = topology.devices(spec, 1)
    hbm = spec.chip.usable_hbm_bytes
    rows = []
    for label, mesh, batch, strategy, length in TPU_CASES:
        config = lm_config(
            "configs/lm_1b.py", max_len=length, mesh=mesh, batch=batch, strategy=strategy
        )
        run = setup(config, devices=devices)
        try:
            state = aot.abstract_state(run)
            train_batch, _ = aot.abstract_batches(run)
            step = aot._compile_step(
                "train", run.train_step, (state, train_batch), run, spec, hbm,
                aot.state_bytes_per_device(state), {},
            )  # fmt: skip
        finally:
            run.close()
        report = dataclasses.asdict(step)
        report.pop("collectives")
        rows.append(dict(label=label, mesh=mesh, batch=batch, strategy=strategy, length=length,
                         hbm_bytes_per_chip=hbm, report=report))  # fmt: skip
        print(label, length, step.total_bytes, step.fits, file=sys.stderr, flush=True)
    return rows


def build_moe() -> dict:
    """Part 3's worker (`trials.serve`): each candidate's training loop on 8 CPU devices."""
    import jax

    from replicator.compiled import hlo as hlo
    from replicator.trainer.setup import setup

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (MOE_BATCH, MOE_LEN + 1)).astype(np.int32)
    candidates = {}
    for label, (mesh, model) in MOE_CANDIDATES.items():
        config = lm_config(
            "configs/lm_tiny.py", max_len=MOE_LEN, mesh=mesh, batch=MOE_BATCH,
            strategy="gather", model=model,
        )  # fmt: skip
        run = setup(config)
        lowered, abstract = lower_train(run)
        analysis = hlo.analyze(lowered.compile().as_text(), run.repl.mesh)
        all_to_all = sum(
            c.bytes * 1.0
            for c in analysis.collectives
            if c.kind == "all-to-all" and not c.in_branch
        )
        collectives = sum(c.bytes for c in analysis.collectives if not c.in_branch)
        params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params))
        batch = run.repl.shard_batch(run.experiment.preprocess({"tokens": tokens}))
        holder = [run.init_state()]

        def steps(k, run=run, batch=batch, holder=holder):
            for _ in range(k):
                holder[0], sums, _ = run.train_step(holder[0], batch)
            return holder[0]

        info = dict(mesh=mesh, model=model, parameters=params, all_to_all_bytes=all_to_all,
                    collective_bytes=collectives, flops=analysis.flops,
                    tokens_per_step=MOE_BATCH * MOE_LEN)  # fmt: skip
        candidates[label] = trials.Candidate(steps, info)
    return candidates


def _child(part: str, env: dict) -> list[dict]:
    argv = [sys.executable, os.path.abspath(__file__), "--child", part]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    done = subprocess.run(argv, cwd=trials.REPO_DIR, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"context_experts --child {part} exited with {done.returncode}")
    return json.loads(done.stdout.splitlines()[-1])


EIGHT_CPUS = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def measure_moe(rounds: int, steps: int) -> dict:
    spec = ("cpu8", "context_experts", "build_moe", {}, EIGHT_CPUS)
    results, info = trials.run_workers([spec], rounds, steps)
    base = "cpu8/dense, data=8"
    rows = []
    for key, cand in info.items():
        stats = trials.time_stats(results, key)
        rows.append(dict(label=key.split("/", 1)[1], **cand, step_s=stats["wall_s"],
                         tokens_per_s=cand["tokens_per_step"] / stats["wall_s"]["median"],
                         speed_vs_dense=trials.ratio_stats(results, key, base)))  # fmt: skip
    return dict(rows=rows, rounds=rounds, steps=steps)


def measure(only: set[str], tpu: bool, rounds: int) -> dict:
    from replicator.trainer.aot import compiler_versions as _versions

    result = {"command": trials.command(), "machine": trials.machine(), "versions": _versions()}
    start = time.perf_counter()
    if not only or "memory" in only:
        result["memory"] = _child("memory", EIGHT_CPUS)
    if tpu and (not only or "tpu" in only):
        result["tpu"] = dict(
            topology=TOPOLOGY, rows=_child("tpu", {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})
        )
    if not only or "moe" in only:
        result["moe"] = measure_moe(rounds, steps=3)
    result["wall_s"] = time.perf_counter() - start
    return result


# ---------------------------------------------------------------- rendering


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def render(result: dict) -> str:
    versions = result.get("versions", {})
    jax_version = versions.get("jax", result.get("machine", {}).get("jax", "?"))
    lines = [
        "## Context and expert parallelism",
        "",
        '`rp.context_attention` and `rp.moe` in the LM (docs/guide.md, "Long sequences and '
        f'experts"), JAX {jax_version}. Command: `.venv/bin/python benchmarks/context_experts.py`'
        " (`--no-tpu` without libtpu).",
    ]
    if result.get("memory"):
        lines += _render_memory(result["memory"])
    if result.get("tpu"):
        lines += _render_tpu(result["tpu"], versions)
    if result.get("moe"):
        lines += _render_moe(result["moe"], result)
    return "\n".join(lines) + "\n"


def _render_memory(rows: list[dict]) -> list[str]:
    by = {(r["label"], r["length"]): r["memory"] for r in rows}
    lines = [
        "",
        "**Activation memory per device against sequence length**, 8 CPU devices "
        "(`--xla_force_host_platform_device_count=8`): the train step of "
        "`configs/lm_tiny.py` (2 layers, width 128, 4 heads, vocabulary 256, float32, no "
        "remat; XLA attention) compiled through `setup` from abstract inputs (global view). "
        "Temporaries per device in MiB (`memory_analysis().temp_size_in_bytes`), the "
        "arguments (state and batch) in brackets, and the ratio to `data=8`'s temporaries:",
        "",
        "| mesh | batch | " + " | ".join(f"T={n:,}" for n in LENGTHS) + " |",
        "|---|---:|" + "---:|" * len(LENGTHS),
    ]
    for label, (_, batch, _) in CPU_MESHES.items():
        cells = []
        for n in LENGTHS:
            m, base = by.get((label, n)), by.get(("data=8", n))
            if m is None:
                cells.append("-")
                continue
            ratio = m["temp_size_in_bytes"] / base["temp_size_in_bytes"] if base else float("nan")
            cells.append(
                f"{_mib(m['temp_size_in_bytes'])} ({_mib(m['argument_size_in_bytes'])}) "
                f"{ratio:.2f}x"
            )
        lines.append(f"| {label} | {batch} | " + " | ".join(cells) + " |")
    return lines + ["", MEMORY_READING]


MEMORY_READING = (
    "Reading: at a global batch of 8 sequences on 8 devices every mesh gives each device "
    "8 x T / 8 tokens, so the per-token activations are the same; what changes is "
    "attention's. Without a `context` axis a device holds one sequence's T x T scores per "
    "head (XLA's attention on CPU); with one, `gather` and `ring` hold one 512 x 512 chunk "
    "of scores at a time (`rp.context_attention`'s `chunk`), `gather` the whole "
    "sequence's keys and values too. A `context` axis earns its keep where the batch "
    "is smaller than the devices: one sequence over `context=8` is what `data=8` cannot "
    "split at all."
)


def _render_tpu(tpu: dict, versions: dict) -> list[str]:
    lines = [
        "",
        f"**The longest sequence that fits a {tpu['topology']} chip** (15.75 GiB of HBM), "
        "`configs/lm_1b.py` (1.01B parameters, remat `full`, bf16, parameters and AdamW "
        "state sharded over `fsdp` and `context`), train step compiled by libtpu "
        f"{versions.get('libtpu', '')} from this CPU host (nothing ran on a TPU). Per-chip "
        "bytes by `replicator.trainer.aot`'s formula "
        "(arguments + outputs - donated + temporaries + code). Without `context` the batch "
        "must split over the 16 chips, so 16 sequences is the least; with `context=8` two "
        "sequences fill the slice:",
        "",
        "| mesh | sequences | T | tokens per step | tokens per chip | temporaries | "
        "per chip | fits | compile |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in tpu["rows"]:
        report = row["report"]
        per_chip = row["batch"] * row["length"] // 16
        lines.append(
            f"| {row['label']} | {row['batch']} | {row['length'] // K}k | "
            f"{row['batch'] * row['length']:,} | {per_chip:,} | "
            f"{_gib(report['breakdown'].get('temporaries', 0))} GiB | "
            f"{_gib(report['total_bytes'])} GiB | {'yes' if report['fits'] else '**no**'} | "
            f"{report['compile_s']:.0f} s |"
        )
    lines += [
        "",
        "One case by hand (it compiles the eval step too): `PYTHONPATH=benchmarks python -m "
        "replicator compile --config configs/lm_1b.py --topology v5e-16 "
        "--config.model.max_len=65536 --config.dataset=context_experts:tokens_65536 "
        '--config.mesh="dict(fsdp=2, context=8)" --config.batch_size=2 '
        "--config.eval_batch_size=2 --config.context_strategy=ring --config.step_path=compile`.",
        "",
        _tpu_reading(tpu["rows"]),
    ]
    return lines


def _tpu_reading(rows: list[dict]) -> str:
    plain = [r for r in rows if "context" not in r["mesh"]]
    split = [r for r in rows if "context" in r["mesh"]]
    longest = max((r["length"] for r in plain if r["report"]["fits"]), default=None)
    beyond = [
        r for r in split if r["report"]["fits"] and (longest is None or r["length"] > longest)
    ]
    if not beyond:
        return "Reading: no `context` mesh fitted a sequence longer than the plain FSDP mesh."
    best = max(beyond, key=lambda r: r["length"])
    missed = [r for r in plain if r["length"] == best["length"]]
    text = (
        f"Reading: without `context` the longest sequence that fits is "
        f"{longest // K if longest else '-'}k tokens; `{best['label']}` fits "
        f"{best['length'] // K}k ({_gib(best['report']['total_bytes'])} GiB per chip)"
    )
    if missed:
        text += (
            f", which FSDP alone needs {_gib(missed[0]['report']['total_bytes'])} GiB per chip "
            "for (at its least batch of 16 sequences)"
        )
    return text + (
        ". The split sequence's attention is XLA's, flash-style in chunks of 512 (one "
        "512 x 512 block of float32 scores per head at a time), where the unsplit sequence "
        "uses splash attention. Before the chunks and before the weights split over "
        "`context` too (this wave), `fsdp=2 context=8` did not fit 64k: 23.7 GiB per chip, "
        "of which 6.4 GiB parameters and AdamW state sharded 2 ways, and T/CP x T/CP float32 "
        "score blocks in HBM."
    )


def _render_moe(moe: dict, result: dict) -> list[str]:
    lines = [
        "",
        f"**Mixture of experts against the dense LM of the same active parameters**, 8 CPU "
        f"devices, global view: 4 layers of width 128, 4 heads, every second MLP a mixture "
        f"of 8 experts of width {EXPERT_MLP} (2 per token, capacity factor 1.25), against "
        f"the dense LM with MLPs of width {DENSE_MLP} (the same MLP parameters per token on "
        f"average); {MOE_BATCH} windows of {MOE_LEN} tokens per step, float32. Medians of "
        f"{moe['rounds']} interleaved rounds of {moe['steps']} steps; all-to-all bytes sent per "
        "device per step from the compiled HLO (`replicator.compiled.hlo.analyze`):",
        "",
        "| model, mesh | parameters | step | tokens/s | speed vs dense | all-to-all per "
        "device | all collectives per device |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in moe["rows"]:
        lines.append(
            f"| {row['label']} | {row['parameters'] / 1e6:.2f}M | "
            f"{trials.fmt_ms(row['step_s']['median'])} ms | {row['tokens_per_s']:,.0f} | "
            f"{trials.fmt_ratio(row['speed_vs_dense'])} | {_mib(row['all_to_all_bytes'])} MiB | "
            f"{_mib(row['collective_bytes'])} MiB |"
        )
    lines += ["", MOE_READING]
    if "machine" in result:
        lines += ["", trials.machine_line(result)]
    return lines


MOE_READING = (
    "Reading: on CPU devices the MoE LM runs at 0.8-0.9 of the dense one with twice its "
    "parameters; dispatching by all-to-all costs about what replicating the experts does "
    "here (the all-to-alls are 8-9 MiB per device per step). Before the activation rule "
    "split the batch over `expert` too, `expert=4 data=2` computed the dense layers 4 "
    "times over (3x the FLOPs of `data=8`) and ran at 0.25."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated: memory,tpu,moe")
    parser.add_argument("--no-tpu", action="store_true", help="skip the libtpu compiles")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--docs-only", action="store_true")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, trials.REPO_DIR)
        rows = child_memory() if args.child == "memory" else child_tpu()
        print(json.dumps(rows, default=float))
        return
    if not args.docs_only:
        result = measure({s for s in args.only.split(",") if s}, not args.no_tpu, args.rounds)
        if (args.only or args.no_tpu) and os.path.exists(RESULT):
            with open(RESULT) as f:
                result = {**json.load(f), **result}
        trials.write_result("context_experts", result)
    with open(RESULT) as f:
        print(render(json.load(f)))


if __name__ == "__main__":
    main()
