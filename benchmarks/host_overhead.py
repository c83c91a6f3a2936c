"""Host overhead per step: replicator's `compile` and `run` against a hand-written `jax.jit` loop.

Usage: .venv/bin/python benchmarks/host_overhead.py [--rounds 20] [--steps 2000]

A step so small that the host's work per call is all there is to time: a
16x16 linear model (weights and bias), squared error, SGD, batch 8, the state
``(params, opt_state)`` donated. One worker process per device count (1 CPU
device, and 8 fake ones via ``--xla_force_host_platform_device_count=8``)
holds every candidate; each round runs each candidate for ``--steps`` steps in
rotated order (benchmarks/trials.py). Replicator waits whenever more than
``max_steps_in_flight`` (2 by default) steps are unfinished. On one device the
hand-written loop never waits; extra rows price replicator's bound (a bound of
4096, which a 2,000-step trial never reaches; the same bound of 2 written by
hand) and the per-call wrapper of `compile` (its ``.jitted`` called directly).
On 8 fake devices an unbounded loop deadlocks XLA:CPU's all-reduce rendezvous
(seen here: 2 and 8 steps in flight ran, 32 aborted after the rendezvous'
40 s timeout), so there the hand-written loop waits as replicator does, and no
unbounded row exists. Goal (issue 16): within 2 µs of jit under `compile`,
within 5 µs under `run`. Writes benchmarks/results/host_overhead.json.
"""

from __future__ import annotations

import collections
import statistics
from typing import Any

import trials

DEVICE_COUNTS = (1, 8)
DEEP = 4096  # an in-flight bound no trial reaches
BOUNDED_JIT = "jit, waits for step i-2 (by hand)"
LABELS = {
    1: (
        "jit",
        BOUNDED_JIT,
        "jit, inside jax.set_mesh each call",
        "compile",
        "compile's .jitted, no wrapper",
        f"compile, {DEEP} in flight",
        "run",
        f"run, {DEEP} in flight",
        "run's program called directly",
        "compile, TrainState",
        "compile's .jitted, TrainState",
        "run, TrainState",
    ),
    8: (
        BOUNDED_JIT,
        "compile",
        "compile's .jitted, waits for step i-2 (by hand)",
        "run",
        "run's program called directly, waits for step i-2 (by hand)",
    ),
}
BASE = {1: "jit", 8: BOUNDED_JIT}


def build(labels: tuple[str, ...] = LABELS[1]) -> dict[str, trials.Candidate]:
    """Worker entry point: the trivial step every way, each with its own donated state.

    Rows other than jit/compile/run price parts of replicator's per-call work: its
    wait on step i-2 written by hand, the mesh context it enters per call, the
    jitted program under `compile` and the cached program under `run` called
    without the wrapper (``Replicator._run_step``, a private method: these rows
    are measurements, not an API).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import replicator as rp

    rng = np.random.default_rng(0)
    host_batch = {
        "x": rng.standard_normal((8, 16)).astype(np.float32),
        "y": rng.standard_normal((8, 16)).astype(np.float32),
    }
    params = {"w": np.zeros((16, 16), np.float32), "b": np.zeros((16,), np.float32)}

    def make_step(tx, reduce_loss):
        def train_step(state, batch):
            params, opt_state = state

            def loss_fn(p):
                residual = batch["x"] @ p["w"] + p["b"] - batch["y"]
                return reduce_loss(jnp.sum(jnp.square(residual), axis=-1))

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        return train_step

    def make_train_state_step(tx):
        def train_step(state, batch):
            def loss_fn(p, batch):
                residual = batch["x"] @ p["w"] + p["b"] - batch["y"]
                return rp.compute_average_loss(jnp.sum(jnp.square(residual), axis=-1))

            loss, grads = state.value_and_grad(loss_fn, batch)
            return state.apply_gradients(grads, tx), loss

        return train_step

    # Same compiler settings for every candidate: replicator's CPU defaults off. The
    # main rows use replicator's default bound (2 on several CPU devices, none on one).
    repls = {d: rp.Replicator(max_steps_in_flight=d, cpu_defaults=False) for d in (None, DEEP)}
    repl = repls[None]
    batch = repl.shard_batch(host_batch)
    out = {}
    for label in labels:
        r = repls[DEEP] if f"{DEEP} in flight" in label else repl
        state = [r.replicate((params, optax.sgd(0.1).init(params)))]
        if "TrainState" in label:
            tx = r.wrap_optimizer(optax.sgd(0.1))
            state = [r.replicate(rp.TrainState.create(params, tx, jax.random.key(0)))]
        if label.startswith("jit"):
            jitted = jax.jit(make_step(optax.sgd(0.1), jnp.mean), donate_argnums=(0,))
            call = lambda s, j=jitted: j(s, batch)
            if "set_mesh" in label:
                call = _in_mesh(call, r.mesh)
        else:
            fn = make_step(r.wrap_optimizer(optax.sgd(0.1)), rp.compute_average_loss)
            if "TrainState" in label:
                fn = make_train_state_step(r.wrap_optimizer(optax.sgd(0.1)))
            if label.startswith("run's program"):
                program, meta, _ = r._run_step(fn, (state[0], batch), (0,))
                call = _flat_call(program, meta, batch)
            elif label.startswith("run"):
                call = lambda s, fn=fn, r=r: r.run(fn, s, batch, donate_argnums=(0,))
            else:
                compiled = r.compile(fn, donate_argnums=(0,))
                call = lambda s, c=compiled: c(s, batch)
                if label.startswith("compile's .jitted"):
                    call = lambda s, j=compiled.jitted: j(s, batch)
        if "(by hand)" in label:
            call = _bounded(call, 2)
        out[label] = trials.Candidate(_loop(call, state), {"devices": jax.device_count()})
    return out


def _in_mesh(call, mesh):
    import jax

    def in_mesh(state):
        with jax.set_mesh(mesh):
            return call(state)

    return in_mesh


def _flat_call(program, meta, batch):
    """What `Replicator.run` calls, without its lookup and bound: flatten, call, unflatten."""
    import jax

    def call(state):
        flat, _ = jax.tree.flatten((state, batch))
        out = program(*flat)  # traced on the first call, which fills in meta
        return jax.tree.unflatten(meta["tree"], out)

    return call


def _bounded(call, depth: int):
    """``call``, waiting for the loss of the step ``depth`` calls back, as replicator does."""
    losses = collections.deque()

    def bounded(state):
        state, loss = call(state)
        losses.append(loss)
        if len(losses) > depth:
            losses.popleft().block_until_ready()
        return state, loss

    return bounded


def _loop(call, state: list):
    def run(k: int):
        loss = None
        for _ in range(k):
            state[0], loss = call(state[0])
        return state[0], loss

    return run


def difference_stats(results, key: str, base: str) -> dict[str, float]:
    """Per round: µs per step of ``key`` minus that of ``base``."""
    groups = trials.by_key(results)
    base_t = {t.round: t.wall_s for t in groups[base]}
    diffs = [1e6 * (t.wall_s - base_t[t.round]) for t in groups[key] if t.round in base_t]
    return trials.quartiles(diffs)


def measure(rounds: int, steps: int) -> dict[str, Any]:
    specs = [
        (
            f"{n}dev",
            "host_overhead",
            "build",
            {"labels": LABELS[n]},
            {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"},
        )
        for n in DEVICE_COUNTS
    ]
    results, _ = trials.run_workers(specs, rounds, steps)
    rows = {}
    for n in DEVICE_COUNTS:
        for label in LABELS[n]:
            key, base = f"{n}dev/{label}", f"{n}dev/{BASE[n]}"
            rows[key] = {
                "us": 1e6 * statistics.median(t.wall_s for t in results if t.key == key),
                "cpu_us": 1e6 * statistics.median(t.cpu_s for t in results if t.key == key),
                "minus_jit_us": difference_stats(results, key, base),
                "vs_jit": trials.ratio_stats(results, key, base),
            }
    return {"rows": rows, "raw": [t.__dict__ for t in results]}


def render(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "## Host overhead per step",
        "",
        "The trivial step (16x16 linear model, squared error, SGD, batch 8, state "
        "donated) timed as a hand-written `jax.jit` loop that never waits and through "
        "replicator, on 1 CPU device and on 8 fake ones, interleaved: "
        f"{result['rounds']} rounds of {result['steps']:,} steps, order rotated every round. "
        "The difference is per round (candidate minus the first row of its device "
        "count), median [min-max]. On 8 devices the hand-written loop must bound its "
        "steps in flight too: unbounded, XLA:CPU's all-reduce rendezvous deadlocks. "
        f"Goal: within 2 µs of jit under `compile`, 5 µs under `run`. JAX {m['jax']}, "
        "replicator's CPU defaults off for every candidate.",
        "",
        "| devices | path | µs/step | minus hand-written, µs | speed vs hand-written "
        "| CPU µs/step |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in result["rows"].items():
        devices, label = key.split("/", 1)
        d = row["minus_jit_us"]
        lines.append(
            f"| {devices.removesuffix('dev')} | {label} | {row['us']:.1f} | "
            f"{d['median']:+.1f} [{d['min']:+.1f} to {d['max']:+.1f}] | "
            f"{trials.fmt_ratio(row['vs_jit'])} | {row['cpu_us']:.1f} |"
        )
    lines += ["", trials.machine_line(result), "", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def main() -> None:
    trials.run_main("host_overhead", __doc__, measure, [render], {"rounds": 20, "steps": 2000})


if __name__ == "__main__":
    main()
