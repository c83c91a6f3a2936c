"""Bytes on the wire per step: the gradients' cross-replica sum in float32 vs `rp.narrow_sum`.

Usage: .venv/bin/python benchmarks/grad_sum.py [--docs-only]

For the models of ``configs/digits_cnn.py`` (the tutorial CNN on 8x8 digits, global
batch 64) and ``configs/lm_tiny.py`` (the 2-layer byte LM, 32 windows of 128
tokens), with Adam, on 8 fake CPU devices under `Replicator.run`: data parallelism
(``data=8``: the gradients all-reduced) and ZeRO (``fsdp=8``: parameters
all-gathered, gradients reduce-scattered). For each, the train step
(``state.value_and_grad``, ``state.apply_gradients``) is lowered with
``repl.wrap_optimizer(adam)`` and with ``aggregate=rp.narrow_sum()``, and the
bytes each device sends per step are read from the HLO with `replicator.compiled.hlo.traffic`
(ring model; collectives inside the non-finite guard's branch counted too, as a
step that updates takes it):

- ``program``: the HLO JAX hands XLA (``lowered.as_text(dialect="hlo")``): what a
  backend with bf16 collectives (GPU's NCCL, TPU) compiles;
- ``XLA:CPU``: the compiled CPU program, whose collectives have no bf16 sum: its
  compiler widens them to f32, so on CPU the narrow sum saves no bytes (it still
  rounds the sum to bf16, as the other backends do).

Writes benchmarks/results/grad_sum.json and prints the ``## Gradient sum in bfloat16``
section of docs/benchmarks.md; ``--docs-only`` re-renders it from the results file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import trials  # noqa: E402

sys.path.insert(0, trials.REPO_DIR)

import replicator as rp  # noqa: E402
from replicator.compiled import hlo as hlo  # noqa: E402

NAME = "grad_sum"
MESHES = {"data=8": ({"data": 8}, "data"), "fsdp=8": ({"fsdp": 8}, "fsdp")}


def config_model(path: str) -> dict:
    spec = importlib.util.spec_from_file_location("config", os.path.join(trials.REPO_DIR, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config().model.to_dict()


def digits_cnn():
    from experiments.classify.model import CNN

    kwargs = {k: v for k, v in config_model("configs/digits_cnn.py").items() if k != "arch"}
    model = CNN(**kwargs)
    batch = {"x": jnp.zeros((64, 8, 8, 1)), "y": jnp.zeros((64,), jnp.int32)}

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return rp.compute_average_loss(per_example)

    return model, batch["x"][:1], batch, loss_fn


def lm_tiny():
    from experiments.lm.model import Transformer

    model = Transformer(**config_model("configs/lm_tiny.py"))
    tokens = jnp.zeros((32, 129), jnp.int32)

    def loss_fn(params, batch):
        nats = model.apply(
            {"params": params}, batch["tokens"][:, :-1], targets=batch["tokens"][:, 1:]
        )
        return rp.compute_average_loss(nats)

    return model, tokens[:1, :-1], {"tokens": tokens}, loss_fn


MODELS = {"digits_cnn": digits_cnn, "lm_tiny": lm_tiny}


def step_bytes(make_model, mesh: dict, axis: str, aggregate) -> dict:
    """Bytes each device sends per step across ``axis``, in the program and compiled."""
    model, example, batch, loss_fn = make_model()
    repl = rp.Replicator(mesh=mesh)
    tx = repl.wrap_optimizer(optax.adam(1e-3), aggregate=aggregate)

    def init(key):
        return rp.TrainState.create(model.init(key, example)["params"], tx, key)

    def step(state, batch):
        loss, grads = state.value_and_grad(loss_fn, batch)
        return state.apply_gradients(grads, tx), loss

    state = repl.init(init, jax.random.key(0))
    lowered = repl.lower(step, state, repl.shard_batch(jax.device_get(batch)))

    def total(text):
        sent = hlo.traffic(text, repl.mesh, axis)
        return sent["every_step"] + sent["in_branches"]

    params = jax.tree.leaves(state.params)
    return {
        "program": total(lowered.as_text(dialect="hlo")),
        "xla_cpu": total(lowered.compile().as_text()),
        "param_bytes": sum(x.size * x.dtype.itemsize for x in params),
    }


def measure() -> dict:
    result = {"machine": trials.machine(), "command": trials.command(), "jax": jax.__version__}
    rows = []
    for model_name, make_model in MODELS.items():
        for mesh_name, (mesh, axis) in MESHES.items():
            f32 = step_bytes(make_model, mesh, axis, None)
            bf16 = step_bytes(make_model, mesh, axis, rp.narrow_sum())
            rows.append({"model": model_name, "mesh": mesh_name, "f32": f32, "bf16": bf16})
            print(rows[-1], flush=True)
    result["rows"] = rows
    return result


READING = """\
Reading it: in the program, the bf16 sum halves the gradients' bytes: all of
data parallelism's traffic (digits 50%), and ZeRO's reduce-scatter, half of
`fsdp`'s traffic beside the f32 parameter all-gather (25-26%). A parameter used
twice (lm_tiny's tied embedding) is all-reduced once in both columns:
`rp.TrainState` sums each replica's own gradient once per parameter (before this
measurement the float32 default let autodiff all-reduce it once per use: 3.35 MB
per step instead of 3.12 MB; `tests/test_aggregate.py` pins it). The saving is
the program's, not measured on an accelerator: this machine has no multi-device
GPU or TPU, and XLA:CPU cannot sum in bf16 (with its widening pass disabled it
refuses: `AllReduce for datatype 'bf16' is not supported`). Training within
bf16's tolerance of float32 is tested in `tests/test_aggregate.py`."""


def render(result: dict) -> str:
    lines = [
        "## Gradient sum in bfloat16",
        "",
        "Bytes each device sends per train step (Adam, `repl.run`, 8 fake CPU devices, JAX "
        f"{result['jax']}), with the gradients summed in float32 (`repl.wrap_optimizer(tx)`)",
        "and in bfloat16 (`aggregate=rp.narrow_sum()`), read from the step's HLO with",
        "`replicator.compiled.hlo.traffic` (ring model: an all-reduce of n bytes over g devices "
        "sends",
        "2n(g-1)/g). *Program*: the HLO JAX hands XLA, what GPU (NCCL) and TPU compile",
        "with bf16 collectives. *XLA:CPU*: the compiled CPU program; its collectives have",
        "no bf16 sum, so XLA widens them to f32 and the bytes do not change there.",
        "Under `fsdp=8` the parameters' all-gather (f32) is part of the total.",
        "",
        "| model | mesh | parameters | program f32 | program bf16 | saved "
        "| XLA:CPU f32 | XLA:CPU bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        f32, bf16 = row["f32"], row["bf16"]
        lines.append(
            f"| {row['model']} | `{row['mesh']}` | {f32['param_bytes']:,} B | "
            f"{f32['program']:,} | {bf16['program']:,} | "
            f"{1 - bf16['program'] / f32['program']:.0%} | "
            f"{f32['xla_cpu']:,} | {bf16['xla_cpu']:,} |"
        )
    lines += ["", f"Command: `{result['command']}`", "", READING]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs-only", action="store_true")
    args = parser.parse_args()
    path = os.path.join(trials.RESULTS_DIR, f"{NAME}.json")
    if args.docs_only:
        with open(path) as f:
            result = json.load(f)
    else:
        result = measure()
        trials.write_result(NAME, result)
    print(render(result))


if __name__ == "__main__":
    main()
