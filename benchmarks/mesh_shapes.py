"""Mesh shapes: configs/lm_tiny.py's model through the trainer's steps at several meshes.

Usage: .venv/bin/python benchmarks/mesh_shapes.py [--rounds 5] [--steps 5] [--devices 8]

For each mesh and step path (``run``: per replica, ZeRO for sharded state;
``compile``: global view), the trainer's own `setup` builds the step, and the
table gives: seconds per step (median over rounds, candidates interleaved in
rotated order in one process), the train state's bytes per device between steps
(the summary's ``state_bytes_per_device``), and XLA's temporary bytes for the
step (scratch memory inside it: activations, gathered parameters). On CPU the
devices are fake (``--xla_force_host_platform_device_count``) and share the
machine's cores, so step times compare the programs, not real interconnects.
Writes benchmarks/results/mesh_shapes.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

MESHES = {
    "data=8": {"data": 8},
    "fsdp=8": {"fsdp": 8},
    "data=2,fsdp=4": {"data": 2, "fsdp": 4},
    "data=4,tensor=2": {"data": 4, "tensor": 2},
    "data=2,fsdp=2,tensor=2": {"data": 2, "fsdp": 2, "tensor": 2},
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lm_tiny(mesh: dict, step_path: str):
    spec = importlib.util.spec_from_file_location("lm_tiny", f"{ROOT}/configs/lm_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.mesh = {"data": 1, "fsdp": 1, "tensor": 1, **mesh}
    config.step_path = step_path
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
    sys.path.insert(0, ROOT)
    import jax

    import experiments.datasets  # noqa: F401  (the offline corpus)
    from replicator.parallel import sharding as sharding
    from replicator.trainer import setup as setup_lib

    candidates = {}
    for name, mesh in MESHES.items():
        for path in ("run", "compile"):
            run = setup_lib.setup(lm_tiny(mesh, path))
            state = run.init_state()
            batch = next(iter(run.repl.distribute(run.train_iterator())))
            compiled = run.train_step.lower(state, batch).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            for _ in range(2):  # compile and warm up
                state, *_ = run.train_step(state, batch)
            jax.block_until_ready(state)
            candidates[f"{name} {path}"] = dict(
                run=run, state=state, batch=batch, times=[],
                bytes=sharding.bytes_per_device(state), temp=temp,
            )  # fmt: skip
    labels = list(candidates)
    for r in range(args.rounds):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            c = candidates[label]
            start = time.perf_counter()
            state = c["state"]
            for _ in range(args.steps):
                state, *_ = c["run"].train_step(state, c["batch"])
            jax.block_until_ready(state)
            c["state"] = state
            c["times"].append((time.perf_counter() - start) / args.steps)
    rows = []
    print("| mesh | path | s/step | state bytes/device | step temp bytes |")
    print("|---|---|---|---|---|")
    for label, c in candidates.items():
        mesh, path = label.rsplit(" ", 1)
        row = dict(
            mesh=mesh, path=path, seconds=statistics.median(c["times"]),
            state_bytes=c["bytes"], temp_bytes=c["temp"],
        )  # fmt: skip
        rows.append(row)
        print(
            f"| {mesh} | {path} | {row['seconds']:.3f} | {c['bytes'] / 1e6:.2f} MB | "
            f"{c['temp'] / 1e6:.2f} MB |"
        )
    out = os.path.join(ROOT, "benchmarks", "results", "mesh_shapes.json")
    with open(out, "w") as f:
        json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
