"""Pipelines (`rp.pipeline`): the compiled schedule's bubble, and what crosses slices.

Usage: .venv/bin/python benchmarks/pipeline.py [--only bubble,slices] [--docs-only]

Two measurements, both read from compiled programs (`replicator.compiled.hlo.analyze`:
FLOPs with loop trip counts, collective bytes by mesh axis, ICI or DCN):

* ``bubble``: a stack of 16 matmul layers pipelined over ``S`` stages on 8 CPU
  devices (``stage`` x ``data``), ``M`` microbatches, ``R`` repeats. Each
  stage's compiled program does ``M*R + S - 1`` iterations of its layers where
  ``M*R`` would do: the measured idle share, ``1 - (FLOPs of the loop over the
  layers on one device / 8) / (FLOPs of one device's program)``, against the formula
  ``(S-1) / (M*R + S-1)`` (`replicator.parallel.pipelining.bubble_fraction`).
* ``slices``: the 8B config (``configs/lm_8b.py``, global batch 512 of 4,096
  tokens) compiled by libtpu for two v5p-128 slices (``python -m replicator
  compile``, nothing runs): FSDP across the slices (``dcn_mesh={'fsdp': 2}``)
  against a pipeline across them (``dcn_mesh={'stage': 2}``, 8 microbatches),
  both with ``fsdp=16, tensor=4`` inside a slice; per-chip memory, DCN and ICI
  bytes per step, roofline step time.

Writes benchmarks/results/pipeline.json and, through `render`, the "Pipelines"
section of docs/benchmarks.md. About 5 minutes on the 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import trials

RESULT = os.path.join(trials.RESULTS_DIR, "pipeline.json")
LAYERS, WIDTH, BATCH = 16, 256, 64
SCHEDULES = [(2, 2, 1), (2, 8, 1), (4, 4, 1), (4, 8, 1), (4, 16, 1), (4, 4, 2), (8, 8, 1)]
SLICES = {
    "fsdp across slices": {"dcn_mesh": "dict(fsdp=2)"},
    "pipeline across slices": {"dcn_mesh": "dict(stage=2)", "pipeline_microbatches": "8"},
}
COMMON = {"mesh": "dict(fsdp=16, tensor=4)", "batch_size": "512", "step_path": "compile"}


def measure_bubbles() -> list[dict]:
    """Each schedule's compiled FLOPs per device against the plain loop's (in a child
    process with 8 CPU devices)."""
    code = f"""
import json, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import replicator as rp
from replicator.compiled import hlo as hlo
from replicator.parallel.pipelining import bubble_fraction
L, W, B = {LAYERS}, {WIDTH}, {BATCH}
layer = lambda p, h: jnp.tanh(h @ p)
params = jax.ShapeDtypeStruct((L, W, W), jnp.float32)
x = jax.ShapeDtypeStruct((B, W), jnp.float32)
def flops(fn, mesh, *args):
    with jax.set_mesh(mesh):
        text = jax.jit(fn).lower(*args).compile().as_text()
    return hlo.analyze(text, mesh).flops
one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(AxisType.Auto,))
loop = flops(lambda p, x: jax.lax.scan(lambda h, q: (layer(q, h), None), x, p)[0], one, params, x)
rows = []
for S, M, R in {SCHEDULES}:
    mesh = jax.make_mesh((8 // S, S), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)
    stacked = NamedSharding(mesh, P("stage"))
    placed = jax.ShapeDtypeStruct(params.shape, params.dtype, sharding=stacked)
    piped = flops(lambda p, x: rp.pipeline(layer, p, x, microbatches=M, repeats=R), mesh, placed, x)
    rows.append(dict(stages=S, microbatches=M, repeats=R, flops_pipeline=piped, flops_loop=loop,
                     measured=1 - loop / 8 / piped, formula=bubble_fraction(S, M, R)))
print(json.dumps(rows))
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=trials.REPO_DIR, env=env, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def compile_slices(workdir: str) -> list[dict]:
    """The 8B config on two v5p-128 slices, FSDP or a pipeline across them."""
    from tpu_programs import compile_case

    rows = []
    for label, overrides in SLICES.items():
        case = dict(
            name=label, config="configs/lm_8b.py", topology="v5p-128", slices=2,
            overrides={**COMMON, **overrides},
        )  # fmt: skip
        rows.append(compile_case(case, os.path.join(workdir, label.split()[0])))
    return rows


def measure(only: set[str]) -> dict:
    result = {"versions": trials.versions()} if hasattr(trials, "versions") else {}
    start = time.perf_counter()
    if not only or "bubble" in only:
        result["bubble"] = measure_bubbles()
    if not only or "slices" in only:
        with tempfile.TemporaryDirectory() as workdir:
            result["slices"] = compile_slices(workdir)
    result["wall_s"] = time.perf_counter() - start
    return result


def _bytes(report: dict, dcn: bool) -> float:
    return sum(c["bytes"] for c in report["collectives"] if c["dcn"] == dcn and not c["in_branch"])


def render(result: dict) -> str:
    lines = [
        "## Pipelines",
        "",
        '`rp.pipeline` (docs/guide.md, "Pipelines"), read from compiled programs. '
        "Command: `.venv/bin/python benchmarks/pipeline.py`.",
        "",
        f"**The bubble of the compiled schedule.** {LAYERS} layers `tanh(h @ W)` of width "
        f"{WIDTH}, a batch of {BATCH}, on 8 CPU devices (`stage` x `data`); measured = 1 - "
        "(FLOPs of the plain loop on one device / 8) / (FLOPs of one device's pipelined "
        "program), with loop trip counts, against (S-1)/(M*R+S-1):",
        "",
        "| stages S | microbatches M | repeats R | measured idle share | formula |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in result.get("bubble", []):
        lines.append(
            f"| {row['stages']} | {row['microbatches']} | {row['repeats']} | "
            f"{row['measured']:.4f} | {row['formula']:.4f} |"
        )
    slices = result.get("slices", [])
    if slices:
        lines += [
            "",
            "**Across two slices.** `configs/lm_8b.py` (7.8B) with a global batch of 512 "
            "windows of 4,096 tokens, `fsdp=16, tensor=4` inside each v5p-128 slice, "
            "compiled by libtpu for two slices (nothing ran on a TPU); per chip and per "
            "train step:",
            "",
            "| across the slices | memory per chip | DCN bytes sent | ICI bytes sent | "
            "roofline step | bound by |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for row in slices:
            if "report" not in row:
                lines.append(f"| {row['name']} | {row.get('error', 'failed')} | | | | |")
                continue
            report = row["report"]
            step = report["train_step"]
            roof = report.get("roofline", {}) or step.get("roofline", {})
            lines.append(
                f"| {row['name']} | {report['memory_per_chip_bytes'] / 2**30:.1f} GiB | "
                f"{_bytes(step, True) / 2**20:,.0f} MiB | {_bytes(step, False) / 2**30:,.1f} GiB"
                f" | {report['roofline_step_s'] * 1e3:,.0f} ms | {roof.get('bound', '')} |"
            )
        commands = [_command(row.get("command", "")) for row in slices]
        lines += ["", "Commands: " + "; ".join(f"`{c}`" for c in commands if c) + ".", ""]
        lines.append(READING)
    return "\n".join(lines) + "\n"


READING = (
    "Reading: the pipeline's DCN bytes are the formula's. Each chip sends its rows of "
    "a microbatch (4 rows x 4,096 x 4,096 in bf16 = 128 MiB) once per iteration forward "
    "and back, 2 x (M*R + S - 1) = 18 permutes = 2.25 GiB; the last stage's output "
    "leaves reduce-scattered (512 MiB) and its gradient comes back all-gathered; the "
    "input's gradient is summed over the stages once (1 GiB). No parameter crosses the "
    "slices. FSDP across the slices instead sends its weight shards there at every "
    "layer, forward and (with remat) again backward, and reduce-scatters the gradients: "
    "7.4 GiB. The pipeline costs memory: 65.5 GiB per chip against 27.6. Part of it "
    "is the price of gathering each stage's layers over fsdp once per step rather than "
    "per microbatch (3.9 GiB of float32 weights per chip, and as much for their "
    "gradients); the rest is not analysed yet. It also computes more: 1.20e15 FLOP per "
    "step against 0.93e15: the bubble (1/9 of a stage's iterations at M=8) is one part, "
    "the rest is not analysed yet either."
)


def _command(command: str) -> str:
    """A compile command as a user types it: no temporary workdir, values quoted."""
    parts = command.split()
    if "--workdir" in parts:
        i = parts.index("--workdir")
        del parts[i : i + 2]
    text = " ".join(parts)
    return re.sub(r"=(dict\([^)]*\))", r'="\1"', text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    parser.add_argument("--docs-only", action="store_true")
    args = parser.parse_args()
    if not args.docs_only:
        result = measure({s for s in args.only.split(",") if s})
        if args.only and os.path.exists(RESULT):
            with open(RESULT) as f:
                result = {**json.load(f), **result}
        with open(RESULT, "w") as f:
            json.dump(result, f, indent=1)
    with open(RESULT) as f:
        print(render(json.load(f)))


if __name__ == "__main__":
    main()
