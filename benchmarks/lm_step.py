"""LM step: replicator's train step against a hand-written `jax.jit` step, same model.

Usage: .venv/bin/python benchmarks/lm_step.py [--model auto|tiny|gpt2_124m|lm_1b|cnn]
       [--rounds N] [--steps K] [--levers] [--flags] [--labels 'A;B']

A GPT-2-shaped decoder-only flax.linen transformer (pre-LN, learned positions,
tied embeddings, causal `jax.nn.dot_product_attention`: cuDNN on GPU, XLA on
CPU; bf16 compute, f32 parameters) trained with `optax.adamw`, or with
``--model cnn`` the tutorial CNN (28x28x1, batch 256, f32, Adam). One worker
process holds every candidate; each round times each candidate for ``--steps``
steps in rotated order (benchmarks/trials.py). The candidates share one copy of
the train state (each hands it to the next; the tuple candidates step
``(params, opt_state)`` of the same `TrainState`), so memory is the same for
all of them and the ~1B model fits once:

* ``jit``: hand-written `jax.jit` step, tuple state ``(params, opt_state)`` donated;
* ``run`` / ``compile``: the same tuple step, replicator style
  (`rp.compute_average_loss`, `Replicator.wrap_optimizer`), under `Replicator.run`
  and `Replicator.compile` of a default `Replicator` (no bound on steps in flight
  but on a mesh of several CPU devices; the H100 rows of 2026-11-26 ran with an
  explicit bound of 2);
* ``compile, TrainState`` / ``run, TrainState``: `rp.TrainState` with
  ``state.value_and_grad`` and ``state.apply_gradients``.

``--levers`` adds what the TrainState gap could be made of, written here as
alternative step functions (the library is unchanged): the update with no
non-finite guard, with a per-leaf ``jnp.where`` guard, with `optax.apply_if_finite`,
a deeper in-flight bound (``Replicator(max_steps_in_flight=64)``), and the
compiled step's ``.jitted`` called directly (no replicator wrapper per call).
``--flags`` adds the latency-hiding scheduler as a compile option. ``--check``
runs every candidate 3 steps from the same state and asserts equal losses;
``--hlo`` compiles every candidate in this process (no run, any model size on a
CPU) and tabulates donation, conditionals, copies and temporary memory.

Ratios are per round, hand-written time / candidate time (> 1: candidate faster),
median [min-max]. MFU counts 6*N*T + 12*L*S*d*T FLOPs per step (N: parameters
without the position table, T tokens per step, L layers, S sequence, d width;
the PaLM/nanoGPT count, attention as if not causal) against the device's dense
bf16 peak (H100/H200: 989 TFLOP/s). Writes benchmarks/results/lm_step_MODEL.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import math
import os
import re
import shutil
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import trials

LEVER_INFLIGHT = 64


@dataclasses.dataclass(frozen=True)
class LMConfig:
    layers: int
    width: int
    heads: int
    vocab: int
    seq: int
    batch: int


MODELS = {
    "tiny": LMConfig(layers=2, width=64, heads=4, vocab=512, seq=64, batch=8),
    "gpt2_124m": LMConfig(layers=12, width=768, heads=12, vocab=50304, seq=1024, batch=16),
    "lm_1b": LMConfig(layers=16, width=2048, heads=16, vocab=50304, seq=2048, batch=4),
}
# Defaults per model: (rounds, steps per trial).
SCHEDULE = {
    "tiny": (5, 3),
    "gpt2_124m": (12, 8),
    "lm_1b": (10, 4),
    "cnn": (15, 300),
}
MAIN = ("jit", "run", "compile", "compile, TrainState", "run, TrainState")
LEVERS = (
    "compile, TrainState, no guard",
    "compile, TrainState, where guard",
    "compile, TrainState, apply_if_finite",
    f"compile, TrainState, {LEVER_INFLIGHT} in flight",
    f"run, TrainState, {LEVER_INFLIGHT} in flight",
    "compile, TrainState, .jitted called directly",
)
FLAGS = ("jit, latency-hiding scheduler", "compile, TrainState, latency-hiding scheduler")
LHS = {"xla_gpu_enable_latency_hiding_scheduler": True}
GUARDS = {"no guard": "none", "where guard": "where", "apply_if_finite": "apply_if_finite"}
DEVICE_FACTS = ("device", "platform", "num_devices", "peak_flops", "jax")


# ----------------------------------------------------------------------- models


def make_lm(cfg: LMConfig, attention: str):
    """The GPT-2-shaped decoder (flax.linen), bf16 compute and f32 parameters."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    init = nn.initializers.normal(0.02)
    dtype = jnp.bfloat16

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x_BxSxD):
            head_dim = cfg.width // cfg.heads
            h = nn.LayerNorm(epsilon=1e-5, dtype=dtype)(x_BxSxD)
            qkv = nn.DenseGeneral((3, cfg.heads, head_dim), dtype=dtype, kernel_init=init)(h)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, S, heads, head_dim]
            a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
            proj = nn.DenseGeneral(cfg.width, axis=(-2, -1), dtype=dtype, kernel_init=init)
            x = x_BxSxD + proj(a)
            h = nn.LayerNorm(epsilon=1e-5, dtype=dtype)(x)
            h = nn.gelu(nn.Dense(4 * cfg.width, dtype=dtype, kernel_init=init)(h))
            return x + nn.Dense(cfg.width, dtype=dtype, kernel_init=init)(h)

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens_BxS):
            embed = nn.Embed(cfg.vocab, cfg.width, embedding_init=init, dtype=dtype)
            pos = self.param("pos_embedding", nn.initializers.normal(0.01), (cfg.seq, cfg.width))
            x = embed(tokens_BxS) + pos[: tokens_BxS.shape[1]].astype(dtype)
            for _ in range(cfg.layers):
                x = Block()(x)
            return embed.attend(nn.LayerNorm(epsilon=1e-5, dtype=dtype)(x))  # tied

    return GPT()


@dataclasses.dataclass
class Task:
    """What the candidates train: parameters, a host batch, a per-example loss."""

    params: Any
    host_batch: dict
    per_example_loss: Callable  # (params, batch) -> [batch]
    tx: Any  # the optax optimizer


def lm_task(cfg: LMConfig, attention: str) -> Task:
    import jax
    import numpy as np
    import optax

    model = make_lm(cfg, attention)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq + 1)).astype(np.int32)
    host_batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = jax.jit(model.init)(jax.random.key(0), host_batch["inputs"][:1])["params"]
    params = jax.device_get(params)  # host copy: placed once, by the shared state

    def per_example_loss(params, batch):
        logits = model.apply({"params": params}, batch["inputs"]).astype("float32")
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return losses.mean(-1)

    n = sum(x.size for x in jax.tree.leaves(params)) - cfg.seq * cfg.width
    assert n == param_count(cfg), (n, param_count(cfg))
    tx = optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    return Task(params, host_batch, per_example_loss, tx)


def cnn_task() -> Task:
    import cnn_steps
    import jax
    import optax

    model = cnn_steps.make_model()
    host_batch = cnn_steps.synthetic_batch()
    params = jax.device_get(model.init(jax.random.key(0), host_batch["image"][:1])["params"])

    def per_example_loss(params, batch):
        logits = model.apply({"params": params}, batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])

    return Task(params, host_batch, per_example_loss, optax.adam(1e-3))


def make_task(model: str) -> Task:
    import jax

    if model == "cnn":
        return cnn_task()
    # implementation=None means XLA's attention in JAX 0.10: ask for cuDNN on GPUs.
    attention = "cudnn" if jax.default_backend() == "gpu" else "xla"
    return lm_task(MODELS[model], attention)


def param_count(cfg: LMConfig) -> int:
    """N: per block 12 d^2 + 13 d, the tied embedding, the final LayerNorm; no positions."""
    d = cfg.width
    return cfg.layers * (12 * d * d + 13 * d) + cfg.vocab * d + 2 * d


# --------------------------------------------------------------- step functions


def tuple_step(per_example_loss, tx, reduce_loss):
    """``(params, opt_state), batch -> new state, loss``: the 30-line loop's step."""
    import jax
    import optax

    def train_step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: reduce_loss(per_example_loss(p, batch)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return train_step


def train_state_step(per_example_loss, tx, guard: str = "cond"):
    """The TrainState step; ``guard`` picks how a non-finite update is skipped.

    ``"cond"`` is `TrainState.apply_gradients` (one `lax.cond` over params and
    optimizer state); ``"none"`` updates unguarded; ``"where"`` selects new or old
    per leaf; ``"apply_if_finite"`` expects ``tx`` wrapped in
    `optax.apply_if_finite`, which guards inside the optimizer.
    """
    import jax
    import jax.numpy as jnp
    import optax

    import replicator as rp
    from replicator.step.state import all_finite

    def loss_fn(params, batch):
        return rp.compute_average_loss(per_example_loss(params, batch))

    def train_step(state, batch):
        loss, grads = state.value_and_grad(loss_fn, batch)
        if guard == "cond":
            return state.apply_gradients(grads, tx), loss
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        skipped = state.skipped_steps
        if guard == "where":
            finite = all_finite(grads)
            keep = lambda new, old: jnp.where(finite, new, old)
            params, opt_state = jax.tree.map(
                keep, (params, opt_state), (state.params, state.opt_state)
            )
            skipped = skipped + (~finite).astype(jnp.int32)
        new = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, skipped_steps=skipped
        )
        return new, loss

    return train_step


# ------------------------------------------------------------------- candidates


class SharedState:
    """The one train state the candidates pass along: each trial takes and returns it."""

    def __init__(self, state):
        self.state = state

    def candidate(self, step: Callable, tuple_state: bool, info: dict) -> trials.Candidate:
        def run(k: int):
            shared = self.state
            state = (shared.params, shared.opt_state) if tuple_state else shared
            loss = None
            for _ in range(k):
                state, loss = step(state)
            if tuple_state:
                self.state = shared.replace(params=state[0], opt_state=state[1])
            else:
                self.state = state
            return state, loss

        return trials.Candidate(run, info)


def hlo_facts(compiled, state) -> dict[str, Any]:
    """Deterministic facts of a compiled step: donation, conditionals, cuDNN attention."""
    import jax

    text = compiled.as_text()
    header = text.split("\n", 1)[0]
    copies = [_bytes(dtype, dims) for dtype, dims in _COPY.findall(text)]
    return {
        "state_leaves": len(jax.tree.leaves(state)),
        "state_bytes": sum(_nbytes(x) for x in jax.tree.leaves(state)),
        "aliased_outputs": header.count("-alias)"),
        "conditionals": text.count(" conditional("),
        "copies": len(copies),
        "copy_bytes": sum(copies),
        "cudnn_attention": "__cudnn$fmha" in text,
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "xla_flops": (compiled.cost_analysis() or {}).get("flops"),
    }


_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\S* copy\(")
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


def _nbytes(x) -> int:
    import jax

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return 8 * math.prod(x.shape)  # threefry key data: 2 x uint32
    return x.dtype.itemsize * math.prod(x.shape)


def _bytes(dtype: str, dims: str) -> int:
    return _ITEMSIZE.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)


_COMPILES = [0]


def _count_compiles(event: str, *args, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


class Program(NamedTuple):
    """One candidate's step: ``call(state, batch)``, ``lower(state, batch)``, its state."""

    call: Callable
    lower: Callable
    holder: str  # which train state it steps: "shared", or "own" (apply_if_finite's)
    tuple_state: bool  # steps (params, opt_state) rather than the TrainState


def make_programs(task: Task, labels, repls) -> tuple[dict[str, Program], dict[str, Any]]:
    """The labelled step programs, and the initial train states they step (host values)."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import replicator as rp

    repl = repls[None]
    tx = repl.wrap_optimizer(task.tx)
    guarded_tx = repl.wrap_optimizer(optax.apply_if_finite(task.tx, 1 << 30))
    states = {"shared": rp.TrainState.create(task.params, tx, jax.random.key(0))}
    if any("apply_if_finite" in label for label in labels):
        states["own"] = rp.TrainState.create(task.params, guarded_tx, jax.random.key(0))
    mirrored = NamedSharding(repl.mesh, P())
    programs = {}
    for label in labels:
        parts = label.split(", ")
        path, is_ts = parts[0], "TrainState" in parts
        r = repls[LEVER_INFLIGHT] if f"{LEVER_INFLIGHT} in flight" in parts else repl
        options = LHS if "latency-hiding scheduler" in parts else None
        if path == "jit":
            fn = tuple_step(task.per_example_loss, task.tx, lambda x: x.mean())
            call = jax.jit(fn, donate_argnums=(0,), out_shardings=(mirrored, None),
                           compiler_options=options)  # fmt: skip
            lower = call.lower
        else:
            if is_ts:
                guard = next((GUARDS[p] for p in parts if p in GUARDS), "cond")
                guard_tx = guarded_tx if guard == "apply_if_finite" else tx
                fn = train_state_step(task.per_example_loss, guard_tx, guard)
            else:
                fn = tuple_step(task.per_example_loss, tx, rp.compute_average_loss)
            if path == "run":
                call = lambda s, b, fn=fn, r=r: r.run(fn, s, b, donate_argnums=(0,))
                lower = lambda s, b, fn=fn, r=r: r.lower(fn, s, b, donate_argnums=(0,))
            else:
                compiled = r.compile(fn, donate_argnums=(0,), compiler_options=options)
                call = compiled.jitted if ".jitted called directly" in parts else compiled
                lower = compiled.lower
        holder = "own" if "apply_if_finite" in parts else "shared"
        programs[label] = Program(call, lower, holder, not is_ts)
    return programs, states


def _replicators(rp) -> dict[int | None, Any]:
    # cpu_defaults=False: replicator and hand-written steps get the same compiler settings.
    return {
        d: rp.Replicator(max_steps_in_flight=d, cpu_defaults=False) for d in (None, LEVER_INFLIGHT)
    }


def _state_arg(state, tuple_state: bool):
    return (state.params, state.opt_state) if tuple_state else state


def build(model: str = "tiny", labels: tuple[str, ...] = MAIN) -> dict[str, trials.Candidate]:
    """Worker entry point: every candidate named in ``labels``, built and warmed up."""
    import jax

    import replicator as rp

    jax.monitoring.register_event_duration_secs_listener(_count_compiles)
    task = make_task(model)
    repls = _replicators(rp)
    programs, states = make_programs(task, labels, repls)
    batch = repls[None].shard_batch(task.host_batch)
    holders = {name: SharedState(repls[None].replicate(s)) for name, s in states.items()}
    out: dict[str, trials.Candidate] = {}
    for label, prog in programs.items():
        holder = holders[prog.holder]
        step = lambda s, call=prog.call: call(s, batch)
        cand = holder.candidate(step, tuple_state=prog.tuple_state, info=device_facts())
        before = _COMPILES[0]
        jax.block_until_ready(cand.run(1))  # compiles
        state = _state_arg(holder.state, prog.tuple_state)
        cand.info.update(hlo_facts(prog.lower(state, batch).compile(), state))
        cand.info["compiles"] = _COMPILES[0] - before  # 1: lower().compile() reused it
        out[label] = cand
    # Every candidate after every other once, so that no trial compiles (checked below).
    for a in out.values():
        for b in out.values():
            a.run(1), b.run(1)
    jax.block_until_ready([h.state for h in holders.values()])
    return {label: _no_compile(label, cand) for label, cand in out.items()}


def check_agreement(model: str, labels: tuple[str, ...], steps: int = 3) -> dict[str, float]:
    """Every candidate from the same initial state for ``steps`` steps: the same loss."""
    import jax
    import numpy as np

    import replicator as rp

    task = make_task(model)
    repls = _replicators(rp)
    programs, states = make_programs(task, labels, repls)
    batch = repls[None].shard_batch(task.host_batch)
    losses = {}
    for label, prog in programs.items():
        state = _state_arg(repls[None].replicate(states[prog.holder]), prog.tuple_state)
        for _ in range(steps):
            state, loss = prog.call(state, batch)
        losses[label] = float(np.mean(jax.device_get(loss)))
        del state
    spread = max(losses.values()) - min(losses.values())
    if spread > 1e-3 * abs(losses["jit"]):
        raise AssertionError(f"candidates disagree after {steps} steps: {losses}")
    return losses


def study_hlo(model: str, labels: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Compiles (never runs) every candidate for this process's backend; its HLO facts.

    Runs on a CPU for any model size: states and batch are abstract.
    """
    import jax

    import replicator as rp

    task = make_task(model)
    repls = _replicators(rp)
    programs, states = make_programs(task, labels, repls)
    repl = repls[None]

    def abstract(tree, sharding):
        shape = lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype, sharding=sharding)
        return jax.tree.map(shape, tree)

    batch = abstract(task.host_batch, repl.batch_sharding)
    states = {name: abstract(s, repl.mirrored_sharding) for name, s in states.items()}
    out = {}
    for label, prog in programs.items():
        state = _state_arg(states[prog.holder], prog.tuple_state)
        out[label] = hlo_facts(prog.lower(state, batch).compile(), state)
        print(label, out[label], flush=True)
    return out


def _no_compile(label: str, cand: trials.Candidate) -> trials.Candidate:
    def run(k: int):
        before = _COMPILES[0]
        out = cand.run(k)
        if _COMPILES[0] != before:
            print(f"WARNING: {label!r} compiled during a timed trial", file=sys.stderr)
        return out

    return trials.Candidate(run, cand.info)


# ------------------------------------------------------------------ coordinator


def device_facts() -> dict[str, Any]:
    """The worker's device, its peak and JAX's version (the coordinator never starts JAX)."""
    import jax

    from replicator.trainer.peaks import data_sheet_peak

    dev = jax.devices()[0]
    chip = data_sheet_peak(dev.device_kind)  # dense bf16; None on CPU: no MFU there
    peak = None if chip is None else chip[0]
    return {
        "device": dev.device_kind,
        "platform": dev.platform,
        "num_devices": jax.device_count(),
        "peak_flops": peak,
        "jax": jax.__version__,
    }


def measure(model: str, rounds: int, steps: int, labels: tuple[str, ...]) -> dict[str, Any]:
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}
    spec = ("w", "lm_step", "build", {"model": model, "labels": list(labels)}, env)
    results, info = trials.run_workers([spec], rounds, steps)
    facts = {k: info["w/jit"][k] for k in DEVICE_FACTS}
    task_info = _task_summary(model)
    rows = {}
    for label in labels:
        key = f"w/{label}"
        wall = trials.time_stats(results, key)
        ms = wall["wall_s"]["median"] * 1e3
        flops = task_info["flops_per_step"]
        mfu = flops / (ms / 1e3) / facts["peak_flops"] if flops and facts["peak_flops"] else None
        rows[label] = {
            **wall,
            "ms": ms,
            "vs_jit": trials.ratio_stats(results, key, "w/jit"),
            "mfu": mfu,
            "hlo": info[key],
        }
    return {**facts, **task_info, "rows": rows, "raw": [t.__dict__ for t in results]}


def _task_summary(model: str) -> dict[str, Any]:
    if model == "cnn":
        import cnn_steps

        return {
            "description": f"tutorial CNN, 28x28x1, batch {cnn_steps.GLOBAL_BATCH}, f32, Adam",
            "flops_per_step": None,
        }
    cfg = MODELS[model]
    d, n, t = cfg.width, param_count(cfg), cfg.batch * cfg.seq
    return {
        "description": f"{cfg.layers} layers, d={d}, {cfg.heads} heads, vocab {cfg.vocab}, "
        f"batch {cfg.batch} x seq {cfg.seq}, {n / 1e6:.1f}M parameters without positions, "
        "bf16 compute, f32 parameters, AdamW",
        "params_n": n,
        "tokens_per_step": t,
        "flops_per_step": 6 * n * t + 12 * cfg.layers * cfg.seq * d * t,
    }


def render(result: dict[str, Any]) -> str:
    """The markdown table of one run."""
    lines = [
        f"{result['model']}: {result['description']}. {result['rounds']} rounds of "
        f"{result['steps']} steps, device {result['device']}, JAX {result['jax']}.",
        "",
        "| model | path | ms/step | vs hand-written jit | MFU | donated/leaves | cond | "
        "cuDNN attn | device | JAX |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, row in result["rows"].items():
        h = row["hlo"]
        mfu = f"{row['mfu']:.1%}" if row["mfu"] else "n/a"
        ms = f"{row['ms']:.3f}" if row["ms"] < 10 else f"{row['ms']:.1f}"
        lines.append(
            f"| {result['model']} | {label} | {ms} | {trials.fmt_ratio(row['vs_jit'])} | {mfu} "
            f"| {h['aliased_outputs']}/{h['state_leaves']} | {h['conditionals']} | "
            f"{'yes' if h['cudnn_attention'] else 'no'} | {result['device']} | {result['jax']} |"
        )
    return "\n".join(lines)


def render_hlo(result: dict[str, Any]) -> str:
    """The table of the compiled programs' facts (``--hlo``)."""
    lines = [
        f"{result['model']}, compiled for {result['backend']} (JAX {result['machine']['jax']}):",
        "",
        "| path | state MB | donated/leaves | conditionals | copies | copied MB | temp MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, f in result["facts"].items():
        lines.append(
            f"| {label} | {f['state_bytes'] / 1e6:.1f} | "
            f"{f['aliased_outputs']}/{f['state_leaves']} | {f['conditionals']} | "
            f"{f['copies']} | {f['copy_bytes'] / 1e6:.1f} "
            f"| {f['temp_bytes'] / 1e6:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="auto", choices=["auto", "cnn", *MODELS])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--levers", action="store_true", help="add the lever study")
    parser.add_argument("--flags", action="store_true", help="add XLA GPU flag candidates")
    parser.add_argument("--hlo", action="store_true", help="compile only, in this process")
    parser.add_argument("--check", action="store_true", help="same loss after 3 steps, then stop")
    parser.add_argument("--labels", help="';'-separated candidates instead (jit always first)")
    args = parser.parse_args()
    model = args.model
    if model == "auto":  # without starting JAX here: the worker needs the whole GPU
        has_gpu = shutil.which("nvidia-smi") and glob.glob("/dev/nvidia[0-9]*")
        model = "gpt2_124m" if has_gpu else "tiny"
    rounds, steps = SCHEDULE[model]
    rounds, steps = args.rounds or rounds, args.steps or steps
    labels = MAIN + (LEVERS if args.levers else ()) + (FLAGS if args.flags else ())
    if args.labels:
        chosen = [x.strip() for x in args.labels.split(";") if x.strip()]
        unknown = [x for x in chosen if x not in MAIN + LEVERS + FLAGS]
        if unknown:
            sys.exit(f"unknown candidates {unknown}; known: {list(MAIN + LEVERS + FLAGS)}")
        labels = ("jit", *(x for x in chosen if x != "jit"))  # the ratios' base
    if args.check:
        for label, loss in check_agreement(model, labels).items():
            print(f"{label}: loss after 3 steps {loss:.6f}")
        return
    if args.hlo:
        import jax

        # Deeper bounds and the bare .jitted compile the same program as their base row.
        labels = tuple(x for x in labels if "in flight" not in x and ".jitted" not in x)
        facts = study_hlo(model, labels)
        result = {"command": trials.command(), "machine": trials.machine(), "model": model}
        result.update(backend=jax.default_backend(), facts=facts)
        path = trials.write_result(f"lm_step_hlo_{model}", result)
        print(render_hlo(result))
        print(f"wrote {path}")
        return
    result = {"command": trials.command(), "machine": trials.machine(), "model": model}
    result.update(rounds=rounds, steps=steps)
    result.update(measure(model, rounds, steps, labels))
    path = trials.write_result(f"lm_step_{model}", result)
    print(render(result))
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
