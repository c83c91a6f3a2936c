"""MaxText's own ahead-of-time compiled train step for a model shaped like configs/lm_1b.py.

Compiles MaxText's training step for a real Cloud TPU topology on this CPU
machine (libtpu from PyPI compiles for the target chips without having them),
so that MaxText's per-chip memory, FLOPs and HBM traffic can be set beside
replicator's. The compile goes through MaxText's own AOT entry point,
``maxtext.trainers.pre_train.train_compile.main``, unchanged: this script only
wraps its ``jit_and_compile`` and ``get_shaped_inputs`` to keep the compiled
object and the abstract state, which ``train_compile`` prints but does not
return. For each compile it writes, under benchmarks/results/maxtext/:

* ``<name>.json``: ``memory_analysis()`` (argument, output,
  temp, generated code and alias bytes per chip), ``cost_analysis()`` (flops,
  bytes accessed), the compile wall time, the parameter count, MaxText's own
  analytic TFLOPs per device, the MaxText / jax / jaxlib / libtpu versions and
  the exact command lines;
* ``<name>.hlo.txt.gz``: the post-optimization HLO (``compiled.as_text()``).

``<name>`` is ``[<model_name>_]<topology>_<slices>_<remat>`` followed by one
suffix for each option away from its default (``_pdb4`` per-device batch,
``_ga4`` gradient accumulation steps, ``_seq4096`` context, ``_noscan``
unscanned layers, ``_attn-<kind>``), so no two cases share a file.

The model is MaxText's ``decoder_block=gpt3`` (pre-LayerNorm with biases, fused
QKV, GELU MLP with one up-projection, learned positions, tied embeddings) at
lm_1b's size: 20 layers, width 2048, 16 heads of 128, MLP 8192, vocabulary 256,
context 2048; float32 weights, bfloat16 activations, AdamW (0.9, 0.95, weight
decay 0.1, clip 1.0), one sequence per chip (``--per-device-batch-size``; each
of ``--grad-accum`` microbatches holds that many), FSDP over every chip of a
slice (``ici_fsdp_parallelism=-1``) and data parallelism across slices.
``--model-name llama3-8b`` compiles MaxText's stock model instead, at its own
defaults (base.yml plus configs/models/llama3-8b.yml: 12 sequences of 2,048
per device, remat ``full``) unless ``--per-device-batch-size``,
``--max-target-length`` or ``--remat`` say otherwise.

Remat: MaxText's policies are ``full`` (its default: save nothing but the block
input), ``minimal``, ``minimal_with_context`` (``minimal`` plus the attention
context: the least recomputation of the named policies), ``save_dot_*``,
``save_qkv_proj``, ``save_out_proj``, ``qkv_proj_offloaded``,
``minimal_offloaded`` and ``custom``. None of them switches remat off for
this model: the scanned block is always wrapped in ``jax.checkpoint``
(maxtext/layers/nnx_decoders.py), and unscanned (``--no-scan``) layers skip it
only when ``remat_policy`` is the string ``"none"``, which MaxText's pyconfig has
already turned into None, so ``--remat none --no-scan`` compiles ``full``
(``jax.checkpoint`` with no policy: the same FLOPs as ``full``, measured).
``minimal_with_context`` saves every named tensor there is in this block.

MaxText is not a dependency of replicator and never imported by it: it lives in
its own virtual environment, and this script runs only there::

    /root/.pyenv/versions/3.12.1/bin/python3.12 -m venv /work/maxtext-venv
    /work/maxtext-venv/bin/pip install "maxtext[tpu]==0.2.5" "jax==0.12.0.1" "libtpu==0.0.52"

    /work/maxtext-venv/bin/python benchmarks/maxtext_compile.py --all
    /work/maxtext-venv/bin/python benchmarks/maxtext_compile.py \\
        --topology v5e-16 --slices 2 --remat minimal
    /work/maxtext-venv/bin/python benchmarks/maxtext_compile.py \\
        --topology v5e-16 --per-device-batch-size 1 --grad-accum 4 --remat none --no-scan
    /work/maxtext-venv/bin/python benchmarks/maxtext_compile.py \\
        --model-name llama3-8b --topology v5p-128

(``jax[tpu]==0.12.0.1`` pins libtpu 0.0.50.*; ``maxtext[tpu]`` alone takes the
newest libtpu, 0.0.52, which jax 0.12.0.1 loads.)

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
from dataclasses import dataclass
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
# What every compile sets, MaxText's stock models included: nothing is read or written.
RUN_OVERRIDES = ["dataset_type=synthetic", "enable_checkpointing=false"]


@dataclass(frozen=True)
class Case:
    """One compile: lm_1b's shape (``model_name`` None) or a MaxText stock model.

    None leaves a setting at the mode's default: lm_1b's (remat full, one sequence
    per device, context 2048, flash attention) or MaxText's own for a stock model.
    """

    topology: str = "v5e-16"
    slices: int = 1
    remat: str | None = None
    attention: str | None = None
    per_device_batch_size: float | None = None
    grad_accum: int = 1
    max_target_length: int | None = None
    scan_layers: bool = True
    model_name: str | None = None

    def overrides(self) -> list[str]:
        """MaxText key=value overrides for this case (after base.yml)."""
        if self.model_name is None:
            out = [*MODEL_OVERRIDES, f"attention={self.attention or 'flash'}"]
            out.append(f"remat_policy={self.remat or 'full'}")
            out.append(f"per_device_batch_size={_number(self.per_device_batch_size or 1)}")
        else:
            out = [f"model_name={self.model_name}", *RUN_OVERRIDES]
            out += [f"attention={self.attention}"] if self.attention else []
            out += [f"remat_policy={self.remat}"] if self.remat else []
            if self.per_device_batch_size is not None:
                out.append(f"per_device_batch_size={_number(self.per_device_batch_size)}")
        if self.max_target_length is not None:
            out.append(f"max_target_length={self.max_target_length}")
            if self.model_name is None:
                out.append(f"trainable_position_size={self.max_target_length}")
        out.append(f"gradient_accumulation_steps={self.grad_accum}")
        out.append(f"scan_layers={str(self.scan_layers).lower()}")
        return out

    def flags(self) -> list[str]:
        """This script's command-line flags for the case."""
        out = ["--topology", self.topology, "--slices", str(self.slices)]
        out += ["--model-name", self.model_name] if self.model_name else []
        out += ["--remat", self.remat] if self.remat else []
        out += ["--attention", self.attention] if self.attention else []
        if self.per_device_batch_size is not None:
            out += ["--per-device-batch-size", _number(self.per_device_batch_size)]
        out += ["--grad-accum", str(self.grad_accum)] if self.grad_accum != 1 else []
        if self.max_target_length is not None:
            out += ["--max-target-length", str(self.max_target_length)]
        return out + ([] if self.scan_layers else ["--no-scan"])


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def case_name(case: Case, config) -> str:
    """The file stem: every setting that differs from lm_1b's defaults, read from
    MaxText's resolved config, so that no two cases share a file."""
    name = f"{case.topology}_{case.slices}_{config.remat_policy or 'none'}"
    name = f"{case.model_name}_{name}" if case.model_name else name
    if float(config.per_device_batch_size) != 1:
        name += f"_pdb{_number(config.per_device_batch_size)}"
    if int(config.gradient_accumulation_steps) != 1:
        name += f"_ga{config.gradient_accumulation_steps}"
    if int(config.max_target_length) != 2048:
        name += f"_seq{config.max_target_length}"
    if not config.scan_layers:
        name += "_noscan"
    if case.attention not in (None, "flash"):
        name += f"_attn-{case.attention}"
    return name


def train_compile_argv(case: Case) -> list[str]:
    """The argv for MaxText's train_compile (its own base.yml plus overrides)."""
    from maxtext.configs import pyconfig

    base_yml = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    return [
        "train_compile.py",
        base_yml,
        "base_output_directory=/tmp/maxtext_aot_output",
        f"run_name={case.model_name or 'lm1b'}_{case.topology}_{case.slices}",
        *case.overrides(),
        f"compile_topology={case.topology}",
        f"compile_topology_num_slices={case.slices}",
        f"dcn_data_parallelism={case.slices}",
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


def run_train_compile(argv: list[str]) -> dict:
    """train_compile.main(argv), keeping the compiled step, config, mesh and state."""
    import jax
    from maxtext.trainers.pre_train import train_compile

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
    start = time.perf_counter()
    try:
        train_compile.main(argv)
    finally:
        train_compile.get_shaped_inputs = original_get_shaped_inputs
        train_compile.jit_and_compile = original_jit_and_compile
        jax.stages.Lowered.compile = original_lowered_compile
    captured["main_s"] = time.perf_counter() - start
    return captured


def compile_one(case: Case, out_dir: Path) -> Path:
    """One AOT compile through train_compile.main; writes the JSON and the gzipped HLO."""
    from flax import nnx
    from maxtext.utils import max_utils, maxtext_utils

    argv = train_compile_argv(case)
    captured = run_train_compile(argv)
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
    name = case_name(case, config)
    hlo_path = out_dir / f"{name}.hlo.txt.gz"
    hlo_text = compiled.as_text()
    with gzip.open(hlo_path, "wt", encoding="utf-8") as f:
        f.write(hlo_text)
    device = mesh.devices.flat[0]
    record = {
        "name": name,
        "what": "MaxText train_step AOT-compiled for a Cloud TPU topology, "
        + (f"MaxText's {case.model_name}" if case.model_name else "lm_1b's shape"),
        "model_name": case.model_name or "lm_1b shape (decoder_block=gpt3)",
        "topology": case.topology,
        "num_slices": case.slices,
        "remat_policy": str(config.remat_policy),
        "attention": str(config.attention),
        "per_device_batch_size": float(config.per_device_batch_size),
        "gradient_accumulation_steps": int(config.gradient_accumulation_steps),
        "scan_layers": bool(config.scan_layers),
        "num_chips": int(mesh.devices.size),
        "device_kind": getattr(device, "device_kind", str(device)),
        "mesh": {axis: int(size) for axis, size in mesh.shape.items() if size > 1},
        "global_batch": int(config.global_batch_size_to_train_on),
        "num_experts": int(config.num_experts),
        "capacity_factor": float(config.capacity_factor),  # -1: dropless (MaxText's default)
        "sparse_matmul": bool(config.sparse_matmul),
        "megablox": bool(config.megablox),
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
            "layer scan, the microbatch loop and the windowed all-gather/reduce-scatter "
            "einsum loops), and Pallas kernels (splash attention) as zero flops",
        },
        "maxtext_analytic_tflops_per_device": {
            "total": tflops,
            "learnable_weights": weight_tflops,
            "attention": attention_tflops,
        },
        "compile_seconds": {
            "xla_compile": round(captured["xla_compile_s"], 2),
            "trace_lower_compile": round(captured["trace_lower_compile_s"], 2),
            "train_compile_main": round(captured["main_s"], 2),
        },
        "hlo": hlo_path.name,
        "hlo_chars": len(hlo_text),
        "versions": versions(),
        "command": shlex.join(
            ["/work/maxtext-venv/bin/python", "benchmarks/maxtext_compile.py", *case.flags()]
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


def run_all(attention: str | None, out_dir: Path, log_dir: Path) -> int:
    """Each compile in its own process, one at a time (each holds several GB)."""
    failures = 0
    for topology, slices, remat in MATRIX:
        case = Case(topology=topology, slices=slices, remat=remat, attention=attention)
        name = f"{topology}_{slices}_{remat}"
        cmd = [sys.executable, os.path.abspath(__file__), *case.flags()]
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
    parser.add_argument("--remat", help="remat_policy: full (default), minimal, none, ...")
    parser.add_argument("--attention", help="flash (default for lm_1b: splash on TPU), ...")
    parser.add_argument(
        "--per-device-batch-size", type=float, help="sequences per device per microbatch"
    )
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--max-target-length", type=int, help="context (default: the mode's)")
    parser.add_argument("--no-scan", action="store_true", help="scan_layers=false")
    parser.add_argument("--model-name", help="a MaxText stock model (e.g. llama3-8b), not lm_1b")
    parser.add_argument("--all", action="store_true", help="the six compiles, one at a time")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.all:
        return 1 if run_all(args.attention, args.out_dir, args.log_dir) else 0
    case = Case(
        topology=args.topology,
        slices=args.slices,
        remat=args.remat,
        attention=args.attention,
        per_device_batch_size=args.per_device_batch_size,
        grad_accum=args.grad_accum,
        max_target_length=args.max_target_length,
        scan_layers=not args.no_scan,
        model_name=args.model_name,
    )
    compile_one(case, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
