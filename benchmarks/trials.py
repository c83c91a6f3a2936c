"""Interleaved, repeated timing of candidates that may each need their own process.

Settings fixed when JAX starts (the fake device count, ``XLA_FLAGS``, malloc
tuning) need one process each. So every *worker* process builds its candidates
(compiles, warms up) and waits; the coordinator then asks each (worker,
candidate) in turn for one trial of ``k`` steps, rotating the order every round.
Load from other users of this shared machine hits all candidates alike, and the
per-trial ratios cancel most of it; we report their median and spread.

Worker side: ``python benchmarks/trials.py MODULE FUNCTION SPEC_JSON`` imports
``MODULE`` from this folder and calls ``FUNCTION(**spec)``, which returns
``{label: Candidate}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
_TAG = "@@trials "


@dataclasses.dataclass
class Candidate:
    """One timed program: ``run(k)`` dispatches k steps and returns what to block on."""

    run: Callable[[int], Any]
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    hlo: str | None = (
        None  # the compiled step's HLO text, where known (not sent to the coordinator)
    )


@dataclasses.dataclass(frozen=True)
class Trial:
    key: str  # "worker/label"
    round: int
    wall_s: float  # per step
    cpu_s: float  # process CPU time per step (all threads)


# ------------------------------------------------------------------ worker side


def serve(candidates: Mapping[str, Candidate], warmup_steps: int = 2) -> None:
    """Warms every candidate up, reports their info, then times trials on request."""
    import jax

    for cand in candidates.values():
        jax.block_until_ready(cand.run(warmup_steps))
    _reply({label: cand.info for label, cand in candidates.items()})
    for line in sys.stdin:
        request = json.loads(line)
        run = candidates[request["label"]].run
        steps = request["steps"]
        cpu0, wall0 = os.times(), time.perf_counter()
        jax.block_until_ready(run(steps))
        wall, cpu1 = time.perf_counter() - wall0, os.times()
        cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        _reply({"wall_s": wall / steps, "cpu_s": cpu / steps})


def _reply(obj: Any) -> None:
    sys.stdout.write(_TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _worker_main(argv: Sequence[str]) -> None:
    module, function, spec = argv
    sys.path.insert(0, REPO_DIR)
    build = getattr(importlib.import_module(module), function)
    serve(build(**json.loads(spec)))


# ------------------------------------------------------------- coordinator side


class Worker:
    """A worker process with its own environment (XLA_FLAGS, malloc settings...)."""

    def __init__(
        self,
        name: str,
        module: str,
        function: str,
        spec: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        launcher: Sequence[str] = (),
    ):
        self.name = name
        self.env = dict(env or {})
        full_env = {**os.environ, **self.env}
        # Every worker starts from the same XLA/JAX settings unless told otherwise.
        if "XLA_FLAGS" not in self.env:
            full_env.pop("XLA_FLAGS", None)
        argv = [*launcher, sys.executable, os.path.abspath(__file__), module, function]
        argv.append(json.dumps(spec or {}))
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=full_env, text=True, bufsize=1
        )
        self.info: dict[str, dict[str, Any]] = {}

    def wait_ready(self) -> Worker:
        """Blocks until the worker has compiled and warmed up its candidates."""
        self.info = self._read()
        return self

    def _read(self) -> Any:
        for line in self.process.stdout:
            if line.startswith(_TAG):
                return json.loads(line[len(_TAG) :])
        raise RuntimeError(f"worker {self.name!r} exited with {self.process.wait()}")

    def time(self, label: str, steps: int) -> dict[str, float]:
        self.process.stdin.write(json.dumps({"label": label, "steps": steps}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def run_trials(workers: Sequence[Worker], rounds: int, steps: int) -> list[Trial]:
    """Times every candidate of every worker once per round, order rotated per round."""
    slots = [(w, label) for w in workers for label in w.info]
    trials = []
    for r in range(rounds):
        shift = r % len(slots)
        for worker, label in slots[shift:] + slots[:shift]:
            t = worker.time(label, steps)
            trials.append(Trial(f"{worker.name}/{label}", r, t["wall_s"], t["cpu_s"]))
    return trials


def start_workers(specs: Iterable[tuple]) -> list[Worker]:
    """Launches all workers at once (they compile in parallel) and waits for them.

    Each spec is ``(name, module, function, spec, env[, launcher])``.
    """
    workers = []
    try:
        for spec in specs:
            workers.append(Worker(*spec))
        for w in workers:
            w.wait_ready()
    except BaseException:
        for w in workers:
            w.close()
        raise
    return workers


def run_workers(specs: Iterable[tuple], rounds: int, steps: int) -> tuple[list[Trial], dict]:
    """Starts the workers of ``specs``, times them interleaved, and closes them.

    Returns:
      The trials, and each candidate's info keyed ``"worker/label"``.
    """
    workers = start_workers(specs)
    try:
        results = run_trials(workers, rounds, steps)
        info = {f"{w.name}/{label}": i for w in workers for label, i in w.info.items()}
    finally:
        for w in workers:
            w.close()
    return results, info


# ------------------------------------------------------------------ statistics


def quartiles(xs: Sequence[float]) -> dict[str, float]:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": q[1], "q1": q[0], "q3": q[2], "min": xs[0], "max": xs[-1]}


def by_key(trials: Sequence[Trial]) -> dict[str, list[Trial]]:
    out: dict[str, list[Trial]] = {}
    for t in trials:
        out.setdefault(t.key, []).append(t)
    return out


def ratio_stats(trials: Sequence[Trial], key: str, base: str) -> dict[str, float]:
    """Speed of ``key`` relative to ``base`` (base time / key time), per round."""
    groups = by_key(trials)
    base_t = {t.round: t.wall_s for t in groups[base]}
    ratios = [base_t[t.round] / t.wall_s for t in groups[key] if t.round in base_t]
    return quartiles(ratios)


def time_stats(trials: Sequence[Trial], key: str) -> dict[str, Any]:
    group = by_key(trials)[key]
    return {
        "wall_s": quartiles([t.wall_s for t in group]),
        "cpu_s": quartiles([t.cpu_s for t in group]),
        "rounds": len(group),
    }


# ------------------------------------------------------------- reporting helpers


def machine() -> dict[str, Any]:
    """Facts about this run's machine and software, for the results file."""
    import jax
    import jaxlib

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def command() -> str:
    """The command line that reproduces this run, from the repository root."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO_DIR)
    return " ".join([".venv/bin/python", script, *map(shlex.quote, sys.argv[1:])])


def write_result(name: str, payload: Mapping[str, Any]) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=float)
        f.write("\n")
    return path


def fmt_ratio(stats: Mapping[str, float]) -> str:
    return f"{stats['median']:.2f} [{stats['min']:.2f}-{stats['max']:.2f}]"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


if __name__ == "__main__":
    _worker_main(sys.argv[1:])


def run_main(
    name: str,
    description: str,
    measure: Callable[..., dict[str, Any]],
    renderers: Sequence[Callable[[dict[str, Any]], str]],
    options: Mapping[str, int],
    finish: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """The benchmarks' shared command line: ``--OPTION N`` flags, measure, save, print.

    ``measure(**options)`` gives the numbers; the result adds the command and the
    machine, ``finish`` may add more (e.g. a plot), and it is written to
    ``results/NAME.json`` and printed through ``renderers``.
    """
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    for option, default in options.items():
        parser.add_argument(f"--{option}", type=int, default=default)
    args = vars(parser.parse_args())
    result = {"command": command(), "machine": machine(), **args, **measure(**args)}
    if finish is not None:
        finish(result)
    path = write_result(name, result)
    for render in renderers:
        print(render(result))
    print(f"wrote {path}")


def machine_line(result: Mapping[str, Any]) -> str:
    """ "Machine: CPU, N cores, load average at start L." for a rendered section."""
    m = result["machine"]
    return (
        f"Machine: {m['cpu']}, {m['cores']} cores, shared (load average at start "
        f"{m['load_average'][0]:.1f})."
    )
