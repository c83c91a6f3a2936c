"""MaxText's own ahead-of-time compiled train step for a model shaped like configs/lm_1b.py.

Compiles MaxText's training step for a real Cloud TPU topology on this CPU
machine (libtpu from PyPI compiles for the target chips without having them),
so that MaxText's per-chip memory, FLOPs and HBM traffic can be set beside
replicator's. The compile goes through MaxText's own AOT entry point,
``maxtext.trainers.pre_train.train_compile.main``, unchanged: this script only
wraps its ``jit_and_compile`` and ``get_shaped_inputs`` to keep the compiled
object and the abstract state, which ``train_compile`` prints but does not
return. For each compile it writes, under benchmarks/results/maxtext/:

* ``<topology>_<slices>_<remat>.json``: ``memory_analysis()`` (argument, output,
  temp, generated code and alias bytes per chip), ``cost_analysis()`` (flops,
  bytes accessed), the compile wall time, the parameter count, MaxText's own
  analytic TFLOPs per device, the MaxText / jax / jaxlib / libtpu versions and
  the exact command lines;
* ``<topology>_<slices>_<remat>.hlo.txt.gz``: the post-optimization HLO
  (``compiled.as_text()``).

The model is MaxText's ``decoder_block=gpt3`` (pre-LayerNorm with biases, fused
QKV, GELU MLP with one up-projection, learned positions, tied embeddings) at
lm_1b's size: 20 layers, width 2048, 16 heads of 128, MLP 8192, vocabulary 256,
context 2048; float32 weights, bfloat16 activations, AdamW (0.9, 0.95, weight
decay 0.1, clip 1.0), one sequence per chip, FSDP over every chip of a slice
(``ici_fsdp_parallelism=-1``) and data parallelism across slices.

MaxText is not a dependency of replicator and never imported by it: it lives in
its own virtual environment, and this script runs only there::

    /root/.pyenv/versions/3.12.1/bin/python3.12 -m venv /work/maxtext-venv
    /work/maxtext-venv/bin/pip install "maxtext[tpu]==0.2.5" "jax[tpu]==0.11.1"

    /work/maxtext-venv/bin/python benchmarks/maxtext_compile.py --all
    /work/maxtext-venv/bin/python benchmarks/maxtext_compile.py \\
        --topology v5e-16 --slices 2 --remat minimal

``--all`` runs the six compiles (v5e-16, v5p-128 and 2 x v5e-16, each with
``remat_policy`` full and minimal) one after another, each in its own process.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

# No TPU is attached: libtpu only compiles here, so it need not take its one-process
# lock (/tmp/libtpu_lockfile), which would fail this run or another libtpu user's.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "maxtext"
MATRIX = [
    (topology, slices, remat)
    for topology, slices in (("v5e-16", 1), ("v5p-128", 1), ("v5e-16", 2))
    for remat in ("full", "minimal")
]
LM_1B_PARAMETERS = 1_011_888_128  # replicator's configs/lm_1b.py

# MaxText's settings for lm_1b's shape; the gpt3 family's switches are those of
# MaxText's configs/models/gpt3-*.yml, with AdamW instead of their adam_pax.
MODEL_OVERRIDES = [
    "decoder_block=gpt3",
    "base_num_decoder_layers=20",
    "base_emb_dim=2048",
    "base_num_query_heads=16",
    "base_num_kv_heads=16",
    "head_dim=128",
    "base_mlp_dim=8192",
    "vocab_size=256",
    "max_target_length=2048",
    "trainable_position_size=2048",  # learned positions
    "mlp_activations=[gelu]",
    "logits_via_embedding=true",  # tied embeddings
    "normalize_embedding_logits=false",
    "logits_dot_in_fp32=false",
    "normalization_layer_epsilon=1.e-05",
    "use_iota_embed=true",
    "fused_qkv=true",
    "enable_dropout=false",
    "dtype=bfloat16",
    "weight_dtype=float32",
    "per_device_batch_size=1",
    "ici_fsdp_parallelism=-1",
    "opt_type=adamw",
    "adam_b1=0.9",
    "adam_b2=0.95",
    "adam_eps=1.e-8",
    "adam_weight_decay=0.1",
    "gradient_clipping_threshold=1.0",
    "learning_rate=3.e-4",
    "steps=2000",
    "dataset_type=synthetic",
    "enable_checkpointing=false",
]


def train_compile_argv(topology: str, slices: int, remat: str, attention: str) -> list[str]:
    """The argv for MaxText's train_compile (its own base.yml plus overrides)."""
    from maxtext.configs import pyconfig

    base_yml = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    return [
        "train_compile.py",
        base_yml,
        "base_output_directory=/tmp/maxtext_aot_output",
        f"run_name=lm1b_{topology}_{slices}_{remat}",
        *MODEL_OVERRIDES,
        f"attention={attention}",
        f"remat_policy={remat}",
        f"compile_topology={topology}",
        f"compile_topology_num_slices={slices}",
        f"dcn_data_parallelism={slices}",
    ]


def versions() -> dict[str, str]:
    out = {}
    for name in ("maxtext", "jax", "jaxlib", "libtpu", "flax", "optax", "tokamax"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    out["python"] = sys.version.split()[0]
    return out


def memory_fields(stats) -> dict[str, int]:
    names = [n for n in dir(stats) if n.endswith("_in_bytes")]
    return {n: int(getattr(stats, n)) for n in sorted(names)}


def compile_one(topology: str, slices: int, remat: str, attention: str, out_dir: Path) -> Path:
    """One AOT compile through train_compile.main; writes the JSON and the gzipped HLO."""
    import jax
    from flax import nnx
    from maxtext.trainers.pre_train import train_compile
    from maxtext.utils import max_utils, maxtext_utils

    captured: dict = {}
    original_jit_and_compile = train_compile.jit_and_compile
    original_get_shaped_inputs = train_compile.get_shaped_inputs
    original_lowered_compile = jax.stages.Lowered.compile

    def get_shaped_inputs(topology_mesh, config):
        result = original_get_shaped_inputs(topology_mesh, config)
        captured.update(config=config, mesh=topology_mesh, state=result[0][0])
        return result

    def lowered_compile(self, *args, **kwargs):
        start = time.perf_counter()
        compiled = original_lowered_compile(self, *args, **kwargs)
        captured["xla_compile_s"] = time.perf_counter() - start
        return compiled

    def jit_and_compile(*args, **kwargs):
        start = time.perf_counter()
        compiled = original_jit_and_compile(*args, **kwargs)
        captured["trace_lower_compile_s"] = time.perf_counter() - start
        captured["compiled"] = compiled
        return compiled

    train_compile.get_shaped_inputs = get_shaped_inputs
    train_compile.jit_and_compile = jit_and_compile
    jax.stages.Lowered.compile = lowered_compile
    argv = train_compile_argv(topology, slices, remat, attention)
    start = time.perf_counter()
    try:
        train_compile.main(argv)
    finally:
        train_compile.get_shaped_inputs = original_get_shaped_inputs
        train_compile.jit_and_compile = original_jit_and_compile
        jax.stages.Lowered.compile = original_lowered_compile
    main_s = time.perf_counter() - start

    compiled, config, mesh = captured["compiled"], captured["config"], captured["mesh"]
    memory = memory_fields(compiled.memory_analysis())
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    cost = {k: float(v) for k, v in (cost or {}).items()}
    params = captured["state"]["model"].filter(nnx.Param)
    num_params = int(max_utils.calculate_num_params_from_pytree(params))
    tflops, weight_tflops, attention_tflops = maxtext_utils.calculate_tflops_training_per_device(
        config, log=False
    )
    per_chip = (
        memory["argument_size_in_bytes"]
        + memory["output_size_in_bytes"]
        - memory["alias_size_in_bytes"]
        + memory["temp_size_in_bytes"]
    )
    name = f"{topology}_{slices}_{remat}"
    hlo_path = out_dir / f"{name}.hlo.txt.gz"
    hlo_text = compiled.as_text()
    with gzip.open(hlo_path, "wt", encoding="utf-8") as f:
        f.write(hlo_text)
    device = mesh.devices.flat[0]
    record = {
        "name": name,
        "what": "MaxText train_step AOT-compiled for a Cloud TPU topology, lm_1b's shape",
        "topology": topology,
        "num_slices": slices,
        "remat_policy": remat,
        "attention": attention,
        "num_chips": int(mesh.devices.size),
        "device_kind": getattr(device, "device_kind", str(device)),
        "mesh": {axis: int(size) for axis, size in mesh.shape.items() if size > 1},
        "global_batch": int(config.global_batch_size_to_train_on),
        "seq_len": int(config.max_target_length),
        "parameters": num_params,
        "parameters_minus_lm_1b": num_params - LM_1B_PARAMETERS,
        "memory_analysis_bytes_per_chip": memory,
        "per_chip_bytes": {
            "arguments": memory["argument_size_in_bytes"],
            "temp": memory["temp_size_in_bytes"],
            "generated_code": memory["generated_code_size_in_bytes"],
            "maxtext_total": per_chip,
            "maxtext_total_note": "argument + output - alias + temp, as MaxText's "
            "max_utils.print_compiled_memory_stats adds them",
            "total_with_code": per_chip + memory["generated_code_size_in_bytes"],
        },
        "cost_analysis": {
            "flops": cost.get("flops"),
            "bytes_accessed": cost.get("bytes accessed"),
            "transcendentals": cost.get("transcendentals"),
            "note": "per chip (the SPMD-partitioned module), one train step, as XLA's cost "
            "analysis counts it: each while loop's body once, whatever its trip count (the "
            "20-layer scan and the windowed all-gather/reduce-scatter einsum loops), and "
            "Pallas kernels (splash attention) as zero flops",
        },
        "maxtext_analytic_tflops_per_device": {
            "total": tflops,
            "learnable_weights": weight_tflops,
            "attention": attention_tflops,
        },
        "compile_seconds": {
            "xla_compile": round(captured["xla_compile_s"], 2),
            "trace_lower_compile": round(captured["trace_lower_compile_s"], 2),
            "train_compile_main": round(main_s, 2),
        },
        "hlo": hlo_path.name,
        "hlo_chars": len(hlo_text),
        "versions": versions(),
        "command": shlex.join(
            [
                "/work/maxtext-venv/bin/python",
                "benchmarks/maxtext_compile.py",
                *("--topology", topology, "--slices", str(slices), "--remat", remat),
                *("--attention", attention),
            ]
        ),
        "train_compile_command": shlex.join(
            ["python", "-m", "maxtext.trainers.pre_train.train_compile", *argv[1:]]
        ),
        "cost_analysis_raw": cost,
    }
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {json_path} and {hlo_path}", flush=True)
    return json_path


def run_all(attention: str, out_dir: Path, log_dir: Path) -> int:
    """Each compile in its own process, one at a time (each holds several GB)."""
    failures = 0
    for topology, slices, remat in MATRIX:
        name = f"{topology}_{slices}_{remat}"
        cmd = [sys.executable, os.path.abspath(__file__), "--topology", topology]
        cmd += ["--slices", str(slices), "--remat", remat, "--attention", attention]
        cmd += ["--out-dir", str(out_dir)]
        with open(log_dir / f"maxtext_{name}.log", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        print(f"{name}: exit {rc} (log {log.name})", flush=True)
        failures += rc != 0
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="v5e-16", help="gcloud name, e.g. v5e-16, v5p-128")
    parser.add_argument("--slices", type=int, default=1, help="compile_topology_num_slices")
    parser.add_argument("--remat", default="full", help="remat_policy: full, minimal, ...")
    parser.add_argument("--attention", default="flash", help="flash (splash on TPU), ...")
    parser.add_argument("--all", action="store_true", help="the six compiles, one at a time")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.all:
        return 1 if run_all(args.attention, args.out_dir, args.log_dir) else 0
    compile_one(args.topology, args.slices, args.remat, args.attention, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
