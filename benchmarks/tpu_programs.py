"""TPU programs: our configs compiled for Cloud TPU slices, beside MaxText's same model.

Usage: .venv/bin/python benchmarks/tpu_programs.py [--only NAME,...] [--python X.Y|PATH]
       [--docs-only]

Every case is one ``python -m replicator compile`` (the trainer's own steps,
compiled by libtpu for the topology from this CPU host; nothing runs), in a
process of its own, read back from its ``report.json``: per-chip memory by kind,
FLOPs, HBM bytes, collective bytes by kind and by ICI/DCN, the roofline step time
(`replicator.trainer.aot.roofline`: the largest of compute, HBM and collective
time at the chip's published peaks). The cases:

* ``shipped``: lm_1b, lm_gpt2_124m, lm_8b and the classifiers as their configs
  are, on the slices they are written for;
* ``levers``: lm_1b at MaxText's shape (one 2,048-token window per chip) on a
  v5e-16 with the levers of issue 32 added one at a time (activation rules,
  splash attention, scanned layers, remat, optimizer offload);
* ``vs_maxtext``: lm_1b at MaxText's shape with remat ``full`` and ``minimal`` on
  v5e-16, v5p-128 and two v5e-16 slices, beside MaxText's own compile of the same
  model (``benchmarks/maxtext_compile.py``, run in MaxText's own virtual
  environment: ``benchmarks/results/maxtext/``). MaxText's HLO is read by the same
  analysis (`replicator.compiled.hlo.analyze`; without its mesh, its collectives are not
  split into ICI and DCN), its memory by the same formula;
* ``vs_maxtext_8b``: ``configs/llama3_8b.py`` and ``configs/lm_8b.py`` on a v5p-128, as
  shipped and at the shapes of MaxText's llama3-8b compiles (its defaults, and lm_8b's
  batch and context), beside those compiles (``benchmarks/results/maxtext/`` files
  named ``llama3-8b*``), with the MFU the roofline allows: ``6 N T / (step x chips x
  peak)``, N the parameters that enter a matrix product (all but the input
  embedding table: `matmul_parameters`), T the tokens of a step, peak the chip's
  bf16 FLOP/s (459 T on a v5p).
* ``vs_maxtext_moe``: ``configs/mixtral_8x7b.py`` and ``configs/qwen3_30b_a3b.py`` (dropless)
  on a v5p-128 at MaxText's default shape (12 windows of 2,048 per chip, remat ``full``),
  beside MaxText's ``mixtral-8x7b`` and ``qwen3-30b-a3b`` at their defaults (files named so
  in ``benchmarks/results/maxtext/``): the share of the experts' FLOPs on padding, and the
  MFU at roofline with N the parameters a token's matrix products use (its ``k`` experts').

Writes benchmarks/results/tpu_programs.json and, through `render`, the "TPU
programs" section of docs/benchmarks.md. About 25 minutes on the 2-core machine.
``--python 3.12`` compiles every case with that Python's JAX and libtpu, the pods'
(``compile --python``: `replicator.runtime.compiler_env`); each table says which
compiler compiled it.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time

import trials

RESULT = os.path.join(trials.RESULTS_DIR, "tpu_programs.json")
MAXTEXT_DIR = os.path.join(trials.RESULTS_DIR, "maxtext")
# One window of 2,048 tokens per chip, as MaxText's per_device_batch_size=1.
PER_CHIP = {"v5e-16": 16, "v4-32": 16, "v5p-128": 64, "v5e-16x2": 32}
# The parameter rules, with the activations left to the compiler (as before issue 32).
UNPLACED_RULES = (
    "(('embed', 'fsdp'), ('mlp', 'tensor'), ('heads', 'tensor'), ('activation_batch', None), "
    "('activation_heads', None), ('activation_mlp', None))"
)


def _case(name, config, topology, slices=1, **overrides) -> dict:
    return dict(name=name, config=config, topology=topology, slices=slices, overrides=overrides)


def cases() -> dict[str, list[dict]]:
    """The compiles, by table."""
    lm1b = "configs/lm_1b.py"
    shipped = [
        _case("lm_1b", lm1b, "v5e-16"),
        _case("lm_1b", lm1b, "v4-32"),
        _case("lm_1b", lm1b, "v5p-128", grad_accum_steps="1"),
        _case("lm_1b", lm1b, "v5e-16", 2, grad_accum_steps="1"),
        _case("lm_gpt2_124m", "configs/lm_gpt2_124m.py", "v5e-16"),
        _case("lm_8b", "configs/lm_8b.py", "v5p-128"),
        _case("lm_8b", "configs/lm_8b.py", "v5p-128", 2, grad_accum_steps="1"),
        _case("digits_cnn", "configs/digits_cnn.py", "v5e-16", batch_size=256),
        _case("gan_digits", "configs/gan_digits.py", "v5e-16", batch_size=256),
    ]
    one = dict(batch_size=16, remat_policy="None", grad_accum_steps="1")
    before = dict(
        one, **{"model.scan_layers": "False", "model.attention": "xla"},
        rules=UNPLACED_RULES,
    )  # fmt: skip
    levers = [
        _case("as before: unrolled, XLA attention, activations unplaced", lm1b, "v5e-16", **before),
        _case("+ activation rules", lm1b, "v5e-16", **{**before, "rules": "None"}),
        _case("+ splash attention", lm1b, "v5e-16", **one, **{"model.scan_layers": "False"}),
        _case("+ scanned layers", lm1b, "v5e-16", **one),
        _case("+ remat minimal", lm1b, "v5e-16", **{**one, "remat_policy": "minimal"}),
        _case("+ remat full", lm1b, "v5e-16", **{**one, "remat_policy": "full"}),
        _case(
            "+ remat full, optimizer state offloaded",
            lm1b,
            "v5e-16",
            **{**one, "remat_policy": "full", "offload_optimizer_state": "True"},
        ),  # fmt: skip
    ]
    ours = []
    # MaxText's cases (benchmarks/results/maxtext/): windows per chip, microbatches, remat.
    for topology, per_chip, accum, remat in (
        *(("v5e-16", 1, 1, r) for r in ("full", "minimal", "minimal_with_context")),
        *(("v5e-16", 4, 1, r) for r in ("full", "minimal")),
        ("v5e-16", 4, 4, "minimal_with_context"),  # lm_1b as shipped
        ("v5e-16", 4, 4, "None"),  # as shipped before: MaxText cannot switch remat off
        *(("v5p-128", 1, 1, r) for r in ("full", "minimal", "minimal_with_context")),
    ):
        batch = PER_CHIP[topology] * per_chip
        ours.append(
            _case(f"replicator remat {remat}, {_windows(per_chip, accum)}", lm1b, topology,
                  batch_size=batch, remat_policy=remat, grad_accum_steps=str(accum))
        )  # fmt: skip
    return {
        "shipped": shipped, "levers": levers, "vs_maxtext": ours, "vs_maxtext_8b": cases_8b(),
        "vs_maxtext_moe": cases_moe(),
    }  # fmt: skip


def _windows(per_chip: int, accum: int) -> str:
    """``4 windows/chip in 4 microbatches``: a row's shape per chip."""
    split = f" in {accum} microbatches" if accum > 1 else ""
    return f"{per_chip} window{'s' if per_chip > 1 else ''}/chip{split}"


def cases_8b() -> list[dict]:
    """The 8B compiles beside MaxText's llama3-8b: each config as shipped (the winner of
    ``compile --fit``), then at MaxText's shapes with MaxText's default remat (``full``)."""
    llama, lm8b = "configs/llama3_8b.py", "configs/lm_8b.py"
    # MaxText's llama3-8b defaults: per_device_batch_size 12 (768 windows on 64 chips)
    # of max_target_length 2,048, remat 'full'.
    at_default = {"batch_size": "768", "model.max_len": "2048", "dataset": "python_stdlib/all_2048"}
    return [
        _case("replicator llama3_8b (as shipped)", llama, "v5p-128"),
        _case("replicator llama3_8b at MaxText's default shape, remat full", llama, "v5p-128",
              remat_policy="full", grad_accum_steps="1", **at_default),
        # Its loss_chunk counts positions: 2,048 of 2,048 makes every logit at once.
        _case("replicator llama3_8b at MaxText's default shape, remat full, loss_chunk=512",
              llama, "v5p-128", remat_policy="full", grad_accum_steps="1",
              **{**at_default, "model.loss_chunk": "512"}),
        _case("replicator lm_8b (as shipped)", lm8b, "v5p-128"),
        _case("replicator lm_8b, remat full", lm8b, "v5p-128", remat_policy="full",
              grad_accum_steps="1"),
    ]  # fmt: skip


def cases_moe() -> list[dict]:
    """The MoE configs as shipped: MaxText's default shape for its mixtral-8x7b and
    qwen3-30b-a3b (768 windows of 2,048 on 64 chips, remat ``full``), dropless."""
    return [
        _case("replicator mixtral_8x7b (as shipped, dropless)", "configs/mixtral_8x7b.py",
              "v5p-128"),
        _case("replicator qwen3_30b_a3b (as shipped, dropless)", "configs/qwen3_30b_a3b.py",
              "v5p-128"),
    ]  # fmt: skip


def matmul_parameters(model: dict) -> int:
    """The parameters that enter a token's matrix products in a decoder of ``model``'s
    keys (the LM's, `experiments.lm`): attention's q, k, v and output, the MLP's (three
    matrices with SwiGLU, two with GELU; with ``num_experts``, the ``experts_per_token``
    experts' and the router) and the output head (the embedding table again where
    tied); not the input embedding (a lookup), norms or biases.

    >>> matmul_parameters(LLAMA3_8B)  # Llama 3 8B: 8.03B parameters, 0.53B input embedding
    7504658432
    >>> matmul_parameters(MIXTRAL_8X7B)  # 46.7B parameters, 12.9B active
    12748587008
    """
    width, heads = model["embed_dim"], model["num_heads"]
    head_dim = model.get("head_dim") or width // heads
    kv = model.get("num_kv_heads") or heads
    attention = 2 * width * heads * head_dim + 2 * width * kv * head_dim
    mlp = (3 if model.get("mlp_activation") == "swiglu" else 2) * width * model["mlp_dim"]
    if model.get("num_experts"):
        mlp = mlp * model.get("experts_per_token", 2) + width * model["num_experts"]
    return model["num_layers"] * (attention + mlp) + width * model["vocab_size"]


# MaxText's llama3-8b (its configs/models/llama3-8b.yml): Llama 3 8B's shape.
LLAMA3_8B = dict(vocab_size=128_256, num_layers=32, embed_dim=4096, num_heads=32,
                 num_kv_heads=8, head_dim=128, mlp_dim=14_336, mlp_activation="swiglu")  # fmt: skip
# MaxText's mixtral-8x7b and qwen3-30b-a3b (configs/models/*.yml), every block MoE.
MIXTRAL_8X7B = dict(LLAMA3_8B, vocab_size=32_000, num_experts=8, experts_per_token=2)
QWEN3_30B_A3B = dict(vocab_size=151_936, num_layers=48, embed_dim=2048, num_heads=32,
                     num_kv_heads=4, head_dim=128, mlp_dim=768, mlp_activation="swiglu",
                     num_experts=128, experts_per_token=8)  # fmt: skip
MOE_MODELS = {"mixtral-8x7b": MIXTRAL_8X7B, "qwen3-30b-a3b": QWEN3_30B_A3B}


def compile_case(case: dict, workdir: str, python: str | None = None) -> dict:
    """One ``python -m replicator compile`` in its own process (``--python``: by that
    Python's JAX); its report.json."""
    argv = [
        sys.executable, "-m", "replicator", "compile", "--config", case["config"],
        "--topology", case["topology"], "--slices", str(case["slices"]), "--workdir", workdir,
        "--steps", "train", *(["--python", python] if python else []),
        *(f"--config.{k}={v}" for k, v in case["overrides"].items()),
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=trials.REPO_DIR, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    # The compile's one folder (compile_<overrides>/): this case's workdir is its own.
    found = glob.glob(os.path.join(workdir, "compile*", "report.json"))
    path = found[0] if found else os.path.join(workdir, "compile", "report.json")
    if not os.path.exists(path):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {**case, "error": " | ".join(tail), "wall_s": seconds}
    with open(path) as f:
        report = json.load(f)
    report.pop("eval_step", None)
    return {**case, "report": report, "exit": done.returncode, "wall_s": seconds,
            "command": " ".join(["python", *argv[1:]])}  # fmt: skip


def maxtext_rows() -> list[dict]:
    """MaxText's compiles (benchmarks/maxtext_compile.py), analysed as ours are."""
    from replicator.compiled import hlo as hlo
    from replicator.compiled import topology as topology
    from replicator.trainer import aot

    rows = []
    for path in sorted(glob.glob(os.path.join(MAXTEXT_DIR, "*.json"))):
        with open(path) as f:
            result = json.load(f)
        with gzip.open(path.removesuffix(".json") + ".hlo.txt.gz", "rt") as f:
            analysis = hlo.analyze(f.read())
        memory = {k: int(v) for k, v in result["memory_analysis_bytes_per_chip"].items()}
        chip = topology.accelerator(result["topology"]).chip
        rows.append(
            dict(
                name=result["name"], topology=result["topology"], slices=result["num_slices"],
                remat=result["remat_policy"], memory=memory, total_bytes=aot.total_bytes(memory),
                flops=analysis.flops, hbm_bytes=analysis.hbm_bytes,
                collective_bytes=analysis.collective_bytes(),
                roofline=aot.roofline(analysis, chip),
                compile_s=result["compile_seconds"]["xla_compile"],
                versions=result["versions"], command=result["command"],
                parameters=result["parameters"], global_batch=result.get("global_batch"),
                seq_len=result.get("seq_len"), is_8b=_is_8b(path, result),
                moe=_moe_model(result), capacity_factor=result.get("capacity_factor", -1.0),
                per_chip=(result.get("global_batch") or result["num_chips"]) // result["num_chips"],
                accum=result.get("gradient_accumulation_steps", 1),
            )
        )  # fmt: skip
    return rows


def _moe_model(result: dict) -> str | None:
    """Which of `MOE_MODELS` a MaxText compile is, or None."""
    return next((name for name in MOE_MODELS if name in str(result.get("name"))), None)


def _is_8b(path: str, result: dict) -> bool:
    """A compile of MaxText's llama3-8b (the 8B table's), not of lm_1b's shape."""
    return "llama3-8b" in os.path.basename(path) or "llama3-8b" in str(result.get("name"))


def measure(only: set[str], python: str | None = None) -> dict:
    result = {"cases": {}, "maxtext": maxtext_rows()}
    with tempfile.TemporaryDirectory() as scratch:
        for table, group in cases().items():
            if only and table not in only:
                continue
            result["cases"][table] = []
            for i, case in enumerate(group):
                print(f"== {table} {case['name']} on {case['topology']} x{case['slices']}",
                      flush=True)  # fmt: skip
                row = compile_case(case, os.path.join(scratch, f"{table}_{i}"), python)
                if table in ("vs_maxtext_8b", "vs_maxtext_moe"):
                    row["shape"] = config_shape(case)
                print("   ", row.get("error") or _brief(row), flush=True)
                result["cases"][table].append(row)
    reports = [r["report"] for rows in result["cases"].values() for r in rows if "report" in r]
    result["versions"] = reports[0]["versions"] if reports else {}
    return result


def compiler_of(rows: list[dict]) -> str:
    """``compiled by jax 0.12.0.1, jaxlib 0.12.0.1, libtpu 0.0.52`` for a table's rows."""
    seen = {json.dumps(r["report"]["versions"]) for r in rows if "report" in r}
    named = [", ".join(f"{k} {v}" for k, v in json.loads(v).items()) for v in sorted(seen)]
    return f"compiled by {' / '.join(named)}" if named else "not compiled"


def config_shape(case: dict) -> dict:
    """A case's step: ``batch`` windows of ``length`` tokens, its remat policy and
    microbatches, and the parameters in 6 N T (`matmul_parameters`), from its config file
    with the case's overrides of those keys."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("case", os.path.join(trials.REPO_DIR,
                                                                       case["config"]))  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    given = case["overrides"]
    model = {**config.model.to_dict(), "max_len": int(given.get("model.max_len",
                                                              config.model.max_len))}  # fmt: skip
    return dict(
        batch=int(given.get("batch_size", config.batch_size)), length=model["max_len"],
        remat=given.get("remat_policy", str(config.remat_policy)),
        microbatches=int(given.get("grad_accum_steps", config.grad_accum_steps)),
        parameters=matmul_parameters(model), padding=_padding(model),
    )  # fmt: skip


def _padding(model: dict) -> float | None:
    """The share of the experts' FLOPs on empty slots (`rp.moe.padding_fraction`);
    None for a dense model."""
    from replicator.parallel import moe as moe

    if not model.get("num_experts"):
        return None
    return moe.padding_fraction(
        model["max_len"], model["num_experts"], model.get("experts_per_token", 2),
        model.get("expert_capacity_factor", 1.25),
    )  # fmt: skip


def _brief(row: dict) -> str:
    report = row["report"]
    return (f"{_gb(report['memory_per_chip_bytes'])} GB, roofline "
            f"{_ms(report['roofline_step_s'])} ms, {row['wall_s']:.0f} s")  # fmt: skip


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _row(label: str, topology: str, report: dict) -> str:
    train = report["train_step"]
    kinds = train["breakdown"]
    parts = train["roofline"]
    collectives = sum(c["bytes"] for c in train["collectives"] if not c.get("in_branch"))
    dcn = sum(c["bytes"] for c in train["collectives"] if c.get("dcn") and not c.get("in_branch"))
    return (
        f"| {label} | {topology} | {_gb(kinds['parameters'] + kinds['optimizer_state'])} | "
        f"{_gb(kinds['temporaries'])} | {kinds['generated_code'] / 1e6:.0f} | "
        f"{_gb(report['memory_per_chip_bytes'])} {'fits' if report['fits'] else '**no**'} | "
        f"{train['flops'] / 1e12:.2f} | {_gb(train['hbm_bytes'])} | {_gb(collectives)} | "
        f"{_gb(dcn)} | {_ms(parts.get('step_s'))} ({parts.get('bound')}) | "
        f"{train['compile_s']:.0f} |"
    )


HEADER = (
    "| program | slice | state GB | temp GB | code MB | total GB | TFLOP | HBM GB | "
    "coll. GB | DCN GB | roofline ms (bound) | compile s |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _slice(row: dict) -> str:
    return row["topology"] + (f" x{row['slices']}" if row["slices"] > 1 else "")


def render(result: dict) -> str:
    lines = [
        "## TPU programs",
        "",
        "Per chip and per train step, compiled by libtpu for the slice from this CPU host "
        "(`python -m replicator compile`; nothing ran on a TPU): state = parameters + "
        "optimizer state in HBM; total = arguments + outputs not donated + temporaries + "
        "generated code, against the chip's HBM; TFLOP and HBM bytes from the optimized "
        "HLO with loop trip counts (`replicator.compiled.hlo.analyze`; the Pallas splash "
        "kernels' FLOPs counted from their shapes, block-causal, in both programs); "
        "collective bytes sent per chip (ring model), "
        "DCN the part between slices; roofline = the largest of compute, HBM, ICI and DCN "
        "time at the chip's published peaks. Command: "
        "`.venv/bin/python benchmarks/tpu_programs.py` "
        f"({json.dumps(result.get('versions', {}))}).",
        "",
    ]
    titles = {
        "shipped": "Configs as shipped, on the slices they are written for:",
        "levers": "lm_1b at one 2,048-token window per chip on a v5e-16, lever by lever "
        "(issue 32; `remat_policy=None` unless named):",
        "vs_maxtext": "lm_1b beside MaxText's own compile of the same model "
        "(1,011,888,128 parameters, gpt3 block, splash attention, 2,048-token windows):",
    }
    lm_1b = [row for row in result["maxtext"] if not row.get("is_8b") and not row.get("moe")]
    for table, rows in result["cases"].items():
        if table == "vs_maxtext_8b":
            lines += _lines_8b(rows, [row for row in result["maxtext"] if row.get("is_8b")])
            continue
        if table == "vs_maxtext_moe":
            lines += _lines_moe(rows, [row for row in result["maxtext"] if row.get("moe")])
            continue
        lines += [f"{titles[table].rstrip(':')} ({compiler_of(rows)}):", "", HEADER]
        for row in rows:
            if "error" in row:
                lines.append(f"| {row['name']} | {_slice(row)} | {row['error'][:120]} |")
            else:
                lines.append(_row(row["name"], _slice(row), row["report"]))
        if table == "vs_maxtext":
            lines += _maxtext_lines(lm_1b)
            lines += ["", MAXTEXT_NOTE.format(**_maxtext_versions(lm_1b))]
        lines.append("")
    return "\n".join(lines)


MAXTEXT_NOTE = (
    "MaxText {maxtext} (jax {jax}, libtpu {libtpu}, Python {python}) in a virtual environment "
    "of its own, never a dependency: `/work/maxtext-venv/bin/python "
    "benchmarks/maxtext_compile.py --topology T --remat R [--per-device-batch-size N] "
    "[--grad-accum K]` (its `train_compile`'s own functions; the JSON and HLO in "
    "`benchmarks/results/maxtext/`), counted from its HLO as ours is. *: MaxText's state "
    "column is all its argument bytes. The two programs are compiled by different "
    "compilers (ours: the table's header); docs/benchmarks.md reads them, and has ours on "
    "MaxText's compiler beside them."
)


def _maxtext_versions(rows: list[dict]) -> dict:
    versions = rows[0]["versions"] if rows else {}
    return {k: versions.get(k, "?") for k in ("maxtext", "jax", "libtpu", "python")}


def _maxtext_lines(rows: list[dict]) -> list[str]:
    out = []
    for row in rows:
        memory = row["memory"]
        state = memory.get("argument_size_in_bytes", 0)
        parts = row["roofline"]
        slices = f" x{row['slices']}" if row["slices"] > 1 else ""
        shape = _windows(int(row["per_chip"]), int(row["accum"] or 1))
        out.append(
            f"| MaxText remat {row['remat']}, {shape} | {row['topology']}{slices} | "
            f"{_gb(state)}* | "
            f"{_gb(memory.get('temp_size_in_bytes'))} | "
            f"{memory.get('generated_code_size_in_bytes', 0) / 1e6:.0f} | "
            f"{_gb(row['total_bytes'])} | {row['flops'] / 1e12:.2f} | {_gb(row['hbm_bytes'])} | "
            f"{_gb(row['collective_bytes'])} | - | {_ms(parts.get('step_s'))} "
            f"({parts.get('bound')}) | {row['compile_s'] or 0:.0f} |"
        )
    return out


HEADER_8B = (
    "| program | batch x context | remat, microbatches | GB/chip | TFLOP/chip | "
    "roofline ms (bound) | MFU at roofline | compile s |\n|---|---|---|---|---|---|---|---|"
)
V5P_PEAK = 459e12  # bf16 FLOP/s per chip (replicator.compiled.topology.CHIPS)


def mfu_at_roofline(parameters: int, tokens: int, step_s: float, chips: int) -> float:
    """``6 N T / (step x chips x peak)`` on v5p chips.

    >>> round(mfu_at_roofline(7_785_676_800, 128 * 4096, 1.130, 64), 3)  # lm_8b, issue 46
    0.738
    """
    return 6 * parameters * tokens / (step_s * chips * V5P_PEAK)


def _row_8b(label, batch, length, remat, gb, flops, parts, mfu, compile_s) -> str:
    return (
        f"| {label} | {batch} x {length} | {remat} | {gb} | {flops / 1e12:.1f} | "
        f"{_ms(parts.get('step_s'))} ({parts.get('bound')}) | {mfu:.1%} | {compile_s:.0f} |"
    )


def _lines_8b(ours: list[dict], maxtext: list[dict]) -> list[str]:
    """The 8B table: our compiles (``vs_maxtext_8b``) above MaxText's llama3-8b."""
    lines = [
        "8B on v5p-128: replicator vs MaxText's llama3-8b (MFU at roofline = 6 N T / "
        "(step x chips x 459 TFLOP/s); N the parameters in matrix products, all but the "
        f"input embedding: {matmul_parameters(LLAMA3_8B):,} for Llama 3 8B; ours "
        f"{compiler_of(ours)}):",
        "", HEADER_8B,
    ]  # fmt: skip
    for row in ours:
        if "error" in row:
            lines.append(f"| {row['name']} | {row['error'][:120]} |")
            continue
        shape, report = row["shape"], row["report"]
        train, step = report["train_step"], report["roofline_step_s"]
        tokens = shape["batch"] * shape["length"]
        mfu = mfu_at_roofline(shape["parameters"], tokens, step, report["chips"])
        fits = "" if report["fits"] else " **no**"
        lines.append(_row_8b(
            row["name"], shape["batch"], shape["length"],
            f"{shape['remat']}, {shape['microbatches']}", _gb(report["memory_per_chip_bytes"])
            + fits, train["flops"], train["roofline"], mfu, train["compile_s"],
        ))  # fmt: skip
    for row in maxtext:
        chips = topology_chips(row["topology"]) * row["slices"]
        tokens = row["global_batch"] * row["seq_len"]
        mfu = mfu_at_roofline(matmul_parameters(LLAMA3_8B), tokens, row["roofline"]["step_s"],
                              chips)  # fmt: skip
        lines.append(_row_8b(
            f"MaxText llama3-8b ({row['name']})", row["global_batch"], row["seq_len"],
            f"{row['remat']}, 1", _gb(row["total_bytes"]), row["flops"], row["roofline"], mfu,
            row["compile_s"] or 0,
        ))  # fmt: skip
    if maxtext:
        lines += ["", MAXTEXT_8B_NOTE.format(**_maxtext_versions(maxtext))]
    return [*lines, ""]


HEADER_MOE = (
    "| program | batch x context | remat | experts' FLOPs on padding | GB/chip | TFLOP/chip | "
    "roofline ms (bound) | MFU at roofline | compile s |\n|---|---|---|---|---|---|---|---|---|"
)


def _lines_moe(ours: list[dict], maxtext: list[dict]) -> list[str]:
    """The MoE table: our dropless configs (``vs_maxtext_moe``) above MaxText's models."""
    lines = [
        "Mixture of experts on v5p-128: replicator vs MaxText's mixtral-8x7b and "
        "qwen3-30b-a3b (MFU at roofline = 6 N T / (step x chips x 459 TFLOP/s), N the "
        f"parameters a token's matrix products use: {matmul_parameters(MIXTRAL_8X7B):,} for "
        f"Mixtral 8x7B, {matmul_parameters(QWEN3_30B_A3B):,} for Qwen3-30B-A3B; ours "
        f"{compiler_of(ours)}):",
        "", HEADER_MOE,
    ]  # fmt: skip
    for row in ours:
        if "error" in row:
            lines.append(f"| {row['name']} | {row['error'][:120]} |")
            continue
        shape, report = row["shape"], row["report"]
        train, step = report["train_step"], report["roofline_step_s"]
        mfu = mfu_at_roofline(shape["parameters"], shape["batch"] * shape["length"], step,
                              report["chips"])  # fmt: skip
        fits = "" if report["fits"] else " **no**"
        lines.append(_row_moe(
            row["name"], shape["batch"], shape["length"], shape["remat"], shape["padding"],
            _gb(report["memory_per_chip_bytes"]) + fits, train["flops"], train["roofline"],
            mfu, train["compile_s"],
        ))  # fmt: skip
    for row in maxtext:
        chips = topology_chips(row["topology"]) * row["slices"]
        tokens = row["global_batch"] * row["seq_len"]
        model = MOE_MODELS[row["moe"]]
        step = row["roofline"]["step_s"]
        mfu = mfu_at_roofline(matmul_parameters(model), tokens, step, chips)
        padding = 0.0 if row.get("capacity_factor", -1.0) <= 0 else None  # -1: dropless
        lines.append(_row_moe(
            f"MaxText {row['moe']} ({row['name']})", row["global_batch"], row["seq_len"],
            row["remat"], padding, _gb(row["total_bytes"]), row["flops"], row["roofline"], mfu,
            row["compile_s"] or 0,
        ))  # fmt: skip
    if maxtext:
        lines += ["", MAXTEXT_MOE_NOTE.format(**_maxtext_versions(maxtext))]
    return [*lines, ""]


def _row_moe(label, batch, length, remat, padding, gb, flops, parts, mfu, compile_s) -> str:
    share = "?" if padding is None else f"{padding:.0%}"
    return (
        f"| {label} | {batch} x {length} | {remat} | {share} | {gb} | {flops / 1e12:.1f} | "
        f"{_ms(parts.get('step_s'))} ({parts.get('bound')}) | {mfu:.1%} | {compile_s:.0f} |"
    )


MAXTEXT_MOE_NOTE = (
    "MaxText {maxtext} (jax {jax}, libtpu {libtpu}, Python {python}), its stock models "
    "(`/work/maxtext-venv/bin/python benchmarks/maxtext_compile.py --model-name M --topology "
    "v5p-128`) at their defaults: dropless (`capacity_factor=-1`), `sparse_matmul` with "
    "megablox's grouped matmul, FSDP over every chip, no expert parallelism; both programs "
    "counted from their optimized HLO by the same analysis (`replicator.compiled.hlo.analyze`; "
    "a Pallas kernel with a cost estimate, as megablox's, counted by it); GB/chip is "
    "arguments + outputs - aliased + temporaries + code, as ours."
)


MAXTEXT_8B_NOTE = (
    "MaxText {maxtext} (jax {jax}, libtpu {libtpu}, Python {python}), its llama3-8b "
    "(`model_name=llama3-8b`) compiled by `benchmarks/maxtext_compile.py` in its own virtual "
    "environment; both programs' FLOPs, bytes and roofline counted from their optimized HLO "
    "by the same analysis (`replicator.compiled.hlo.analyze`, splash attention's kernels "
    "counted from their shapes in both); GB/chip is MaxText's arguments + outputs - aliased "
    "+ temporaries + code, as ours."
)


def topology_chips(name: str) -> int:
    """Chips in one slice of ``name`` (``v5p-128``: 64)."""
    from replicator.compiled import topology as topology

    return topology.accelerator(name).chips


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        default="",
        help="tables: shipped, levers, vs_maxtext, vs_maxtext_8b, vs_maxtext_moe",
    )
    parser.add_argument("--docs-only", action="store_true")
    parser.add_argument(
        "--python", default=None, help="compile with this Python's JAX (compile --python)"
    )
    args = parser.parse_args()
    if not args.docs_only:
        only = set(filter(None, args.only.split(",")))
        result = measure(only, args.python)
        if only and os.path.exists(RESULT):  # keep the other tables' last numbers
            with open(RESULT) as f:
                previous = json.load(f)
            result["cases"] = {**previous.get("cases", {}), **result["cases"]}
        os.makedirs(trials.RESULTS_DIR, exist_ok=True)
        with open(RESULT, "w") as f:
            json.dump(result, f, indent=1)
    with open(RESULT) as f:
        result = json.load(f)
    if args.docs_only:  # MaxText's compiles as they are now, and ours as last measured
        result["maxtext"] = maxtext_rows()
    print(render(result))


if __name__ == "__main__":
    main()
