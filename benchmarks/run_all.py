"""Runs every benchmark and regenerates their sections of docs/benchmarks.md.

Usage: .venv/bin/python benchmarks/run_all.py [--quick] [--only efficiency,scaling]
       [--docs-only]

Runs efficiency, throughput (MFU), scaling and compile one after another (each
interleaves its own candidates), then benchmarks/loader.py and
benchmarks/checkpoint.py when they exist; raw numbers land in
benchmarks/results/*.json. The sections this script owns are rewritten from
those files; every other section of docs/benchmarks.md is left as it is.
About 9 minutes on the 2-core development machine (``--quick``: about 4), plus
about 25 for benchmarks/tpu_programs.py (libtpu compiles of our configs for TPU
slices; ``--only`` leaves it out unless named) and 5 for benchmarks/pipeline.py.
``--docs-only`` rewrites the sections from the existing results files.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import trials

DOC = os.path.join(trials.REPO_DIR, "docs", "benchmarks.md")
# name -> (full arguments, quick arguments); the order is the order in the doc.
OURS = {
    "efficiency": (["--rounds", "30"], ["--rounds", "4"]),
    "throughput": (["--rounds", "10"], ["--rounds", "4"]),
    "scaling": (["--rounds", "8"], ["--rounds", "3"]),
    "compile": (["--rounds", "2"], ["--rounds", "1"]),
}
# Their docs sections are written by hand.
OTHERS = (
    "loader", "checkpoint", "precision", "host_overhead", "lm_step", "loss_chunk", "storage",
    "grad_sum", "tpu_programs", "pipeline", "context_experts",
)  # fmt: skip
PREAMBLE = """# Benchmarks

Measured side by side on the development machine (a shared 2-core AMD EPYC VM,
no accelerator): the compared programs run in one run, interleaved and
repeated, and we report medians of per-round ratios with their spread. Every
section names the exact command; `make bench` (`benchmarks/run_all.py`) reruns
them all and rewrites the tables. Raw numbers: `benchmarks/results/*.json`.
"""


def run_script(name: str, args: list[str]) -> float:
    start = time.perf_counter()
    path = os.path.join(trials.BENCH_DIR, f"{name}.py")
    print(f"== {name} {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, path, *args], check=True, cwd=trials.REPO_DIR)
    return time.perf_counter() - start


def sections() -> dict[str, str]:
    """Our rendered sections, keyed by their ``## `` heading line."""
    import checkpoint
    import compile as compile_bench
    import context_experts
    import efficiency
    import grad_sum
    import pipeline
    import precision
    import scaling
    import storage
    import throughput
    import tpu_programs

    modules = {
        "efficiency": efficiency,
        "throughput": throughput,
        "scaling": scaling,
        "compile": compile_bench,
        "checkpoint": checkpoint,
        "precision": precision,
        "storage": storage,
        "grad_sum": grad_sum,
        "tpu_programs": tpu_programs,
        "pipeline": pipeline,
        "context_experts": context_experts,
    }
    out = {}
    for name, module in modules.items():
        path = os.path.join(trials.RESULTS_DIR, f"{name}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            result = json.load(f)
        texts = [module.render(result)]
        if hasattr(module, "render_findings"):
            texts.append(module.render_findings(result))
        for text in texts:
            text = text.rstrip() + "\n"
            out[text.splitlines()[0]] = text
    return out


def splice(doc: str, new_sections: dict[str, str]) -> str:
    """Replaces the sections whose heading matches; appends the new ones."""
    blocks, current = [], []
    for line in doc.splitlines(keepends=True):
        if line.startswith("## ") and current:
            blocks.append("".join(current))
            current = []
        current.append(line)
    if current:
        blocks.append("".join(current))
    pending = dict(new_sections)
    out = []
    for block in blocks:
        heading = block.splitlines()[0].rstrip()
        if heading in pending:
            out.append(pending.pop(heading) + "\n")
        else:
            out.append(block if block.endswith("\n\n") else block.rstrip("\n") + "\n\n")
    out.extend(text + "\n" for text in pending.values())
    return "".join(out).rstrip("\n") + "\n"


def update_docs() -> None:
    doc = open(DOC).read() if os.path.exists(DOC) else ""
    if not doc.startswith("# "):
        doc = PREAMBLE + "\n" + doc
    # Other scripts edit this file too: write a whole new file and rename it into place.
    text = splice(doc, sections())  # renders first: a failure leaves no file behind
    tmp = f"{DOC}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, DOC)
    print(f"updated {os.path.relpath(DOC, trials.REPO_DIR)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("--docs-only", action="store_true")
    args = parser.parse_args()
    if not args.docs_only:
        only = set(filter(None, args.only.split(",")))
        spent = {}
        for name, (full, quick) in OURS.items():
            if not only or name in only:
                spent[name] = run_script(name, quick if args.quick else full)
        for name in OTHERS:
            if os.path.exists(os.path.join(trials.BENCH_DIR, f"{name}.py")) and (
                not only or name in only
            ):
                spent[name] = run_script(name, [])
        print("seconds:", {k: round(v) for k, v in spent.items()})
    update_docs()


if __name__ == "__main__":
    main()
