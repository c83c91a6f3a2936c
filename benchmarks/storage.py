"""A run on a bucket vs on a local disk: checkpoint stalls and the metric writers.

Usage: .venv/bin/python benchmarks/storage.py [--trials 7] [--mb 16] [--steps 60]

Starts the test suite's GCS server (gcp-storage-emulator on 127.0.0.1,
tests/gcs_server.py), reached through the libraries' own variables, and
measures, interleaved, local first and bucket first in alternate trials:

1. the time one checkpoint save blocks a training loop, as the trainer saves:
   `Checkpoints.save` (asynchronous) of a replicated state of --mb megabytes on
   8 fake CPU devices, whose commit waits for the metric files to be made
   durable (`MetricWriter.sync`: nothing to do locally, an upload to the bucket);
2. the time `MetricWriter.write` takes per record in the step loop;
3. the digits CNN trained for --steps steps with a record every step, whole
   runs with the workdir local or in the bucket: seconds per step.

The server is a local process, so these numbers show what replicator adds on
top of the storage service, not a real bucket's latency. Writes
benchmarks/results/storage.json.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

import replicator as rp  # noqa: E402
from replicator import trainer  # noqa: E402
from replicator.trainer.writers import MetricWriter  # noqa: E402
from tests import gcs  # noqa: E402


def make_state(repl, megabytes):
    rows = megabytes * 2**20 // (4 * 1024 * 4)
    keys = jax.random.split(jax.random.key(0), 4)
    params = {f"w{i}": jax.random.normal(k, (rows, 1024)) for i, k in enumerate(keys)}
    return repl.replicate({"params": params, "step": jnp.int32(0)})


def save_stall(workdir, repl, state, step, records=True):
    """Blocking time of one trainer-style save (the records uploaded before its commit),
    or with ``records=False`` of Orbax's save alone."""
    writer = save_stall.writers[workdir]
    for i in range(20):  # a few records since the last save
        writer.write(step * 100 + i, {"loss": 0.5, "accuracy": 0.9})
    manager = save_stall.managers[workdir]
    manager.wait()  # the previous save is done: time this save alone
    jax.block_until_ready(state)
    start = time.perf_counter()
    manager.save(step, state, before_commit=writer.sync if records else None)
    blocked = time.perf_counter() - start
    manager.wait()
    return {"blocked_s": blocked, "total_s": time.perf_counter() - start}


def write_cost(writer, records):
    start = time.perf_counter()
    for i in range(records):
        writer.write(i, {"loss": 0.5, "accuracy": 0.9, "learning_rate": 1e-3})
    return (time.perf_counter() - start) / records


def digits_run(workdir, data_dir, steps):
    from tests.test_train import load_config

    config = load_config(
        data_dir=data_dir,
        num_train_steps=steps,
        log_every_steps=1,
        eval_every_steps=steps,
        checkpoint_every_steps=steps // 2,
    )
    start = time.perf_counter()
    trainer.train_and_evaluate(config, workdir, quiet=True)
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--mb", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    absl_logging.set_verbosity(absl_logging.ERROR)
    import experiments.datasets  # noqa: F401  (registers digits)
    from replicator.trainer import data

    local_root = tempfile.mkdtemp(prefix="storage-bench-")
    data_dir = os.path.join(local_root, "tfds")
    data.load_data_source("digits", "train", data_dir=data_dir)
    with gcs.emulator():
        bucket = gcs.new_bucket()
        roots = {
            "local": os.path.join(local_root, "run"),
            "bucket": f"{bucket}/run",
            "orbax": f"{bucket}/orbax_only",  # the bucket, Orbax's save without our records
        }
        repl = rp.Replicator()
        state = make_state(repl, args.mb)
        save_stall.managers = {
            r: rp.Checkpoints(f"{r}/checkpoints", repl, keep=2) for r in roots.values()
        }
        save_stall.writers = {r: MetricWriter(r, resume_step=None) for r in roots.values()}
        saves, writes = [], []
        for trial in range(args.trials + 1):  # trial 0 warms up
            order = ("local", "bucket", "orbax")[trial % 3 :] + ("local", "bucket", "orbax")[
                : trial % 3
            ]
            row = {
                where: save_stall(roots[where], repl, state, trial, records=where != "orbax")
                for where in order
            }
            cost = {
                where: write_cost(save_stall.writers[roots[where]], 200)
                for where in order
                if where != "orbax"
            }
            if trial:
                saves.append(row)
                writes.append(cost)
        for r in roots.values():
            save_stall.managers[r].close()
            save_stall.writers[r].close()
        runs = []
        for run in range(args.runs):
            order = ("local", "bucket") if run % 2 else ("bucket", "local")
            runs.append(
                {w: digits_run(f"{roots[w]}/digits{run}", data_dir, args.steps) for w in order}
            )

    def median(rows, where, key=None):
        return statistics.median(r[where][key] if key else r[where] for r in rows)

    ratios = [r["bucket"]["blocked_s"] / r["local"]["blocked_s"] for r in saves]
    orbax_ratios = [r["orbax"]["blocked_s"] / r["local"]["blocked_s"] for r in saves]
    step_ratios = [r["bucket"] / r["local"] for r in runs]
    summary = {
        "devices": jax.device_count(),
        "state_mb": args.mb,
        "trials": args.trials,
        "save_blocked_local_s": median(saves, "local", "blocked_s"),
        "save_blocked_bucket_s": median(saves, "bucket", "blocked_s"),
        "save_blocked_orbax_only_s": median(saves, "orbax", "blocked_s"),
        "save_blocked_orbax_only_ratio": {
            "median": statistics.median(orbax_ratios),
            "min": min(orbax_ratios),
            "max": max(orbax_ratios),
        },
        "save_total_local_s": median(saves, "local", "total_s"),
        "save_total_bucket_s": median(saves, "bucket", "total_s"),
        "save_blocked_ratio": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        },
        "write_local_s": median(writes, "local"),
        "write_bucket_s": median(writes, "bucket"),
        "digits_steps": args.steps,
        "digits_step_local_s": median(runs, "local"),
        "digits_step_bucket_s": median(runs, "bucket"),
        "digits_step_ratio": {
            "median": statistics.median(step_ratios),
            "min": min(step_ratios),
            "max": max(step_ratios),
        },
        "command": ".venv/bin/python benchmarks/storage.py",
    }
    out = os.path.join(REPO, "benchmarks", "results", "storage.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"summary": summary, "saves": saves, "writes": writes, "runs": runs}, f, indent=2)
    print(json.dumps(summary, indent=2))


def render(result: dict) -> str:
    """The ``## Storage: local disk vs bucket`` section of docs/benchmarks.md."""
    s = result["summary"]
    b, d = s["save_blocked_ratio"], s["digits_step_ratio"]
    o = s["save_blocked_orbax_only_ratio"]
    write_share = (s["write_bucket_s"] - s["write_local_s"]) / s["digits_step_local_s"]
    return "\n".join(
        [
            "## Storage: local disk vs bucket",
            "",
            f"The test suite's GCS server (gcp-storage-emulator on 127.0.0.1) against the "
            f"local disk, interleaved; {s['devices']} fake CPU devices; median [min-max] of "
            f"per-trial ratios. Command: `{s['command']}`. The server is a local process: "
            "this is what replicator adds, not a real bucket's latency.",
            "",
            "| measure | local | bucket | ratio | goal |",
            "|---|---|---|---|---|",
            f"| loop blocked per checkpoint save ({s['state_mb']} MB state, {s['trials']} "
            f"trials: async `save`, records uploaded before its commit) | "
            f"{1e3 * s['save_blocked_local_s']:.1f} ms | "
            f"{1e3 * s['save_blocked_bucket_s']:.1f} ms | "
            f"{b['median']:.2f} [{b['min']:.2f}-{b['max']:.2f}] | <= 1.5 |",
            f"| the same save on the bucket without the records (Orbax alone) | | "
            f"{1e3 * s['save_blocked_orbax_only_s']:.1f} ms | "
            f"{o['median']:.2f} [{o['min']:.2f}-{o['max']:.2f}] | |",
            f"| `MetricWriter.write` per record | {1e6 * s['write_local_s']:.0f} us | "
            f"{1e6 * s['write_bucket_s']:.0f} us | "
            f"{s['write_bucket_s'] / s['write_local_s']:.2f} | extra < 1% of a step |",
            f"| digits CNN, a record every step ({s['digits_steps']} steps, whole runs) | "
            f"{1e3 * s['digits_step_local_s']:.1f} ms/step | "
            f"{1e3 * s['digits_step_bucket_s']:.1f} ms/step | "
            f"{d['median']:.3f} [{d['min']:.3f}-{d['max']:.3f}] | |",
            "",
            f"A save's whole time, background included: "
            f"{1e3 * s['save_total_local_s']:.0f} ms local, "
            f"{1e3 * s['save_total_bucket_s']:.0f} ms to the bucket. The upload of the "
            "metric files runs inside the save, as its `before_commit` (Orbax commits the "
            "step only after it: a kill never leaves a checkpoint whose records are "
            "missing), so the loop does not wait for it: the trainer's save blocks "
            f"{1e3 * (s['save_blocked_bucket_s'] - s['save_blocked_orbax_only_s']):+.1f} ms "
            "against Orbax's own save to the same bucket. The rest of the bucket's extra "
            "blocking is Orbax's (its save to `gs://` starts more work before it returns: "
            "tensorstore's GCS writer, the step directory's creation); running the local "
            "server at the lowest CPU priority did not change it. A record "
            f"written to a bucket workdir costs the step loop "
            f"{1e6 * (s['write_bucket_s'] - s['write_local_s']):+.0f} us against a local "
            f"one ({100 * write_share:+.2f}% of a "
            f"{1e3 * s['digits_step_local_s']:.1f} ms digits step): it is the same local "
            "append, and the uploads run on a background thread. The whole-run row also "
            "holds the bucket's setup (the write check, reading back config and metrics) "
            "and the final uploads, spread over the steps.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
