"""``python -m replicator compile --fit``: the fastest program that fits, found by compiling.

A user who finds that a run does not fit, or is slower than it should be, tries
remat policies, gradient accumulation and optimizer-state offload by hand, a
compile each. `search` does it for them: it compiles the candidates for the
topology, each in a child process of its own (``python -m replicator compile
--steps=train`` with the candidate's ``--config.KEY=VALUE`` on top of the
command line's), and reads their reports: the train step's memory per chip,
whether it fits, its roofline step time and what bounds it. The fastest that
fits wins; its overrides are printed ready to paste.

The candidates, in rounds:

1. every remat policy (`replicator.step.remat.REMAT_POLICIES`), the config's
   accumulation and offload as given;
2. for each policy that does not fit and could still beat the fastest that
   does (its roofline unknown, or lower), and for each that fits as fast as the
   fastest (within 1%: smaller pieces may need less memory at the same speed):
   ``grad_accum_steps`` doubled, then quadrupled (while the batch splits), then
   the optimizer state in host memory (``step_path='compile'`` only).

Among programs equally fast (within 1%) the one needing the least memory per chip
wins: the same speed with more headroom.

A child that dies by a signal (libtpu can answer a far-too-large program with
SIGSEGV) is a candidate that does not fit, and the search goes on. Children run
``jobs`` at a time (each holds a whole compile in host memory: by default one
per two cores and 8 GiB of free memory, at most 2). Each outcome is cached on
disk (``$XDG_CACHE_HOME/replicator/fit``), keyed by the config file, the
overrides, the topology, the compiler's versions and the code of replicator and
of the experiment: a rerun is instant, an edit recompiles. The roofline leaves
out what crosses PCIe to host memory (offloaded activations or optimizer state):
among equals the search prefers what keeps everything in HBM.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import glob
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

from replicator import storage
from replicator.runtime import compiler_env, worker_env
from replicator.step import remat
from replicator.trainer import compile_report
from replicator.trainer.compile_report import GiB, bound_text, duration_text, size_text

log = logging.getLogger("replicator")

# The keys a candidate sets, in the order they are shown.
KEYS = ("remat_policy", "grad_accum_steps", "offload_optimizer_state")
FITS, DOES_NOT_FIT, REFUSED, FAILED = "fits", "does not fit", "refused", "failed"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One program to try: config overrides on top of the command line's (none: the
    config as given, whose own values ``given`` shows)."""

    overrides: tuple[tuple[str, str], ...]
    given: str = ""

    @property
    def label(self) -> str:
        """``remat_policy=minimal grad_accum_steps=2``, or ``remat_policy=full (as given)``."""
        if not self.overrides:
            return f"{self.given} (as given)".lstrip()
        return " ".join(f"{k}={v}" for k, v in self.overrides)

    def flags(self) -> list[str]:
        """The overrides as ``--config.KEY=VALUE`` words."""
        return [f"--config.{k}={v}" for k, v in self.overrides]


@dataclasses.dataclass
class Outcome:
    """What compiling one candidate's train step gave.

    Attributes:
      candidate: the candidate.
      status: `FITS`, `DOES_NOT_FIT`, `REFUSED` (the config refuses the combination)
        or `FAILED` (an error that is not the candidate's size).
      memory_bytes: the train step's HBM per chip (None where nothing compiled).
      roofline_s: its roofline step time (None where there is no program).
      bound: what bounds it: compute, hbm, ici or dcn.
      mfu_ceiling: the MFU its roofline allows, counting every FLOP it runs (recomputed
        ones too): 100% wherever compute bounds it.
      flops: the train step's FLOPs per chip (None where there is no program).
      message: why it was refused or failed, or how the compiler crashed.
      seconds: how long the compile took (0 when cached).
      cached: read from the cache.
      report: the child's report.json (None without one).
      eval_memory_bytes: the eval step's HBM per chip, where this child compiled it.
    """

    candidate: Candidate
    status: str
    memory_bytes: int | None = None
    roofline_s: float | None = None
    bound: str | None = None
    mfu_ceiling: float | None = None
    message: str = ""
    seconds: float = 0.0
    cached: bool = False
    report: str | None = None
    eval_memory_bytes: int | None = None
    flops: float | None = None

    @property
    def fits(self) -> bool:
        """Whether the train step fits a chip's HBM."""
        return self.status == FITS


@dataclasses.dataclass
class Search:
    """What a search is over: the command line's config, topology and the compiler.

    Attributes:
      config_file: ``--config``'s value (``FILE[:MODE]``).
      overrides: the command line's ``--config.KEY=VALUE`` (key to text).
      config: the config they give (for the candidates' choices and the cache key).
      accelerator: the accelerator type, as `replicator.trainer.aot.canonical_accelerator`
        names it.
      slices: how many slices.
      cache_dir: where outcomes are cached.
      jobs: children compiling at a time.
      python: the children's interpreter.
      policies: the remat policies of the first round (all of them by default).
    """

    config_file: str
    overrides: dict[str, str]
    config: ml_collections.ConfigDict
    accelerator: str
    slices: int = 1
    cache_dir: str = ""
    jobs: int = 1
    python: str = sys.executable
    policies: tuple[str | None, ...] = remat.REMAT_POLICIES

    def __post_init__(self):
        self.cache_dir = self.cache_dir or default_cache_dir()


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/replicator/fit`` (``~/.cache/replicator/fit`` by default)."""
    return str(worker_env.cache_dir("fit"))


def default_jobs() -> int:
    """Children at a time: one per two cores and per 8 GiB of available memory, 1 to 2."""
    cores = (os.cpu_count() or 1) // 2
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        free = 8 * GiB
    return max(1, min(2, cores, free // (8 * GiB)))


# ---------------------------------------------------------------- the candidates


def first_round(
    config: ml_collections.ConfigDict, policies: Sequence[str | None] = remat.REMAT_POLICIES
) -> list[Candidate]:
    """Each of ``policies``, the config's own first (as given: no override); only the
    config as given where its experiment has no ``remat_policy`` (no named tensors)."""
    own = config.get("remat_policy")
    others = [p for p in policies if p != own] if "remat_policy" in config else []
    defaults = {"grad_accum_steps": 1, "offload_optimizer_state": False}
    given = " ".join(
        f"{k}={config.get(k)}"
        for k in KEYS
        if k in config and (k not in defaults or config.get(k) != defaults[k])
    )
    return [Candidate((), given)] + [Candidate((("remat_policy", str(p)),)) for p in others]


def second_round(
    config: ml_collections.ConfigDict, outcomes: Sequence[Outcome], devices: int
) -> list[Candidate]:
    """For each policy that does not fit and might beat the fastest that does: more
    microbatches (while the batch splits over ``devices`` into them), then the
    optimizer state in host memory; for each that fits as fast as the fastest, more
    microbatches."""
    best = fastest(outcomes)
    tried = {o.candidate for o in outcomes}
    accum = int(config.get("grad_accum_steps", 1) or 1)
    more = [accum * f for f in (2, 4) if config.batch_size % (accum * f * devices) == 0]
    offload = config.get("step_path") == "compile" and not config.get("offload_optimizer_state")
    found = []
    for outcome in outcomes:
        if outcome.status in (REFUSED, FAILED) or not _worth_splitting(outcome, best):
            continue
        base = outcome.candidate.overrides
        if not base and "remat_policy" in config:
            base = (("remat_policy", str(config.get("remat_policy"))),)
        steps = [base + (("grad_accum_steps", str(k)),) for k in more]
        if offload and not outcome.fits:
            steps.append(base + (("offload_optimizer_state", "True"),))
        found += [Candidate(c) for c in steps if Candidate(c) not in tried]
    return list(dict.fromkeys(found))


def _worth_splitting(outcome: Outcome, best: Outcome | None) -> bool:
    """Whether more microbatches of ``outcome`` might win: it does not fit and might be
    faster than the fastest that does, or it fits as fast as that (within 1%), where
    smaller pieces run the same FLOPs in less memory."""
    if best is None or outcome.roofline_s is None:
        return not outcome.fits
    if outcome.fits:
        return outcome.roofline_s <= best.roofline_s * 1.01
    return outcome.roofline_s < best.roofline_s  # else no faster than what fits


def fastest(outcomes: Sequence[Outcome]) -> Outcome | None:
    """The fitting outcome of the lowest roofline; among equals (within 1%), one that
    keeps everything in HBM, then the one needing the least memory per chip (the same
    speed with more headroom), then fewer overrides."""
    fitting = [o for o in outcomes if o.fits and o.roofline_s is not None]
    if not fitting:
        return None
    low = min(o.roofline_s for o in fitting)
    near = [o for o in fitting if o.roofline_s <= low * 1.01]
    return min(near, key=lambda o: (_offloads(o), o.memory_bytes or 0, len(o.candidate.overrides)))


def _offloads(outcome: Outcome) -> bool:
    """Whether the candidate moves anything to host memory, which its roofline leaves out."""
    values = dict(outcome.candidate.overrides)
    policy = values.get("remat_policy", "")
    return values.get("offload_optimizer_state") == "True" or policy.endswith("_offloaded")


# ---------------------------------------------------------------- the search


def search(run: Search, on_outcome: Callable[[Outcome, int, int], None]) -> list[Outcome]:
    """Compiles the candidates, round by round (module docstring), ``run.jobs`` at a time.

    Args:
      run: the config, topology and compiler.
      on_outcome: called with each outcome as it comes, its number and how many
        there are in its round.

    Returns:
      Every outcome, in the order the candidates were made.
    """
    from replicator.compiled import topology

    devices = topology.accelerator(run.accelerator).devices_per_slice * run.slices
    first = first_round(run.config, run.policies)
    outcomes = _compile_all(run, first, on_outcome, eval_first=True)
    more = second_round(run.config, outcomes, devices)
    if more:
        log.info("  then %d more: the policies that do not fit, in smaller pieces", len(more))
        outcomes += _compile_all(run, more, on_outcome)
    return outcomes


def _compile_all(run: Search, candidates, on_outcome, *, eval_first: bool = False):
    results: dict[int, Outcome] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, run.jobs)) as pool:
        futures = {
            pool.submit(compile_candidate, run, c, eval_first and i == 0): i
            for i, c in enumerate(candidates)
        }
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            outcome = future.result()
            results[futures[future]] = outcome
            on_outcome(outcome, done, len(candidates))
    return [results[i] for i in range(len(candidates))]


def compile_candidate(run: Search, candidate: Candidate, with_eval: bool = False) -> Outcome:
    """One candidate's outcome: from the cache, or compiled in a child process."""
    key = cache_key(run, candidate, with_eval)
    entry = os.path.join(run.cache_dir, key)
    cached = _read_cached(entry, candidate)
    if cached is not None:
        return cached
    overrides = {**run.overrides, **dict(candidate.overrides)}
    steps = "train,eval" if with_eval else "train"
    argv = [
        run.python, "-m", "replicator", "compile", "--config", run.config_file,
        *(f"--config.{k}={v}" for k, v in overrides.items()),
        "--topology", run.accelerator, "--slices", str(run.slices),
        "--workdir", os.path.join(entry, "run"), f"--steps={steps}",
    ]  # fmt: skip
    log.info("  compiling %s ...", candidate.label)
    shutil.rmtree(os.path.join(entry, "run"), ignore_errors=True)  # a failed try's remains
    os.makedirs(entry, exist_ok=True)
    start = time.perf_counter()
    with open(os.path.join(entry, "child.log"), "w") as out:
        out.write(shlex.join(argv) + "\n")
        out.flush()
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    outcome = read_outcome(entry, candidate, code)
    outcome.seconds = time.perf_counter() - start
    if outcome.status != FAILED:  # a failure may be passing (no memory here, a kill)
        _write_cached(entry, outcome)
    return outcome


def read_outcome(entry: str, candidate: Candidate, code: int) -> Outcome:
    """A child's outcome from its exit status and its report (if it wrote one)."""
    found = sorted(glob.glob(os.path.join(entry, "run", "compile*", "report.json")))
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        return Outcome(candidate, DOES_NOT_FIT, message=f"the compiler crashed ({name})")
    if not found or code not in (0, 2):
        return Outcome(candidate, REFUSED if code == 2 else FAILED, message=_last_error(entry))
    with open(found[0]) as f:
        report = json.load(f)
    train = report["train_step"]
    eval_step = report.get("eval_step")
    return Outcome(
        candidate, FITS if train["fits"] else DOES_NOT_FIT, train["total_bytes"],
        train["roofline"].get("step_s"), train["roofline"].get("bound"),
        train["roofline"].get("mfu_ceiling"),
        message=_oom_note(train), report=found[0],
        eval_memory_bytes=None if not eval_step else eval_step["total_bytes"],
        flops=train.get("flops"),
    )  # fmt: skip


def _oom_note(train: dict) -> str:
    """The row's note where XLA ran out of memory compiling the step (the report has
    XLA's message)."""
    ran_out = any(n.startswith("XLA ran out") for n in train.get("notes", []))
    return "XLA ran out of memory compiling it" if ran_out else ""


def _last_error(entry: str) -> str:
    try:
        lines = pathlib.Path(entry, "child.log").read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    errors = [line for line in lines if line.startswith("error: ")]
    shown = errors[-1].removeprefix("error: ") if errors else (lines[-1] if lines else "")
    return shown[:300]


# ---------------------------------------------------------------- the cache


def cache_key(run: Search, candidate: Candidate, with_eval: bool) -> str:
    """The hash of all a candidate's program depends on: the config file's text, the
    overrides, the topology, the steps compiled, the compiler's versions and the code."""
    from replicator.trainer.aot import compiler_versions

    path = run.config_file.split(":", 1)[0]
    material = {
        "config_file": run.config_file,
        "config_text": pathlib.Path(path).read_text() if os.path.isfile(path) else "",
        "overrides": sorted({**run.overrides, **dict(candidate.overrides)}.items()),
        "topology": run.accelerator,
        "slices": run.slices,
        "steps": "train,eval" if with_eval else "train",
        "versions": compiler_versions(),
        "code": code_digest(run.config.experiment),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]


@functools.cache
def code_digest(experiment: str) -> str:
    """A hash of replicator's Python files and the experiment's package (once per
    process: the candidates of one search share it)."""
    roots = [pathlib.Path(__file__).resolve().parent.parent]
    spec = importlib.util.find_spec(experiment.split(".")[0])
    if spec is not None and spec.origin:
        roots.append(pathlib.Path(spec.origin).parent)
    digest = hashlib.sha256()
    for root in roots:
        for file in sorted(root.rglob("*.py")):
            digest.update(str(file.relative_to(root)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def _read_cached(entry: str, candidate: Candidate) -> Outcome | None:
    try:
        with open(os.path.join(entry, "outcome.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    saved.pop("candidate", None)
    return Outcome(candidate, **{**saved, "cached": True, "seconds": 0.0})


def _write_cached(entry: str, outcome: Outcome) -> None:
    saved = dataclasses.asdict(outcome)
    saved["candidate"] = outcome.candidate.label
    for key in ("cached", "seconds"):
        saved.pop(key)
    tmp = os.path.join(entry, "outcome.json.tmp")
    with open(tmp, "w") as f:
        json.dump(saved, f, indent=2)
    os.replace(tmp, os.path.join(entry, "outcome.json"))


# ---------------------------------------------------------------- what is printed


def outcome_line(outcome: Outcome, done: int, total: int) -> str:
    """The progress line of one finished candidate."""
    when = "cached" if outcome.cached else f"{outcome.seconds:.0f} s"
    return f"  [{done}/{total}] {outcome.candidate.label}: {_result(outcome)} ({when})"


def _result(outcome: Outcome) -> str:
    if outcome.status in (REFUSED, FAILED):
        return f"{outcome.status}: {outcome.message}"
    text = f"{size_text(outcome.memory_bytes)} per chip, {outcome.status}"
    if outcome.roofline_s is not None:
        text += f"; roofline {duration_text(outcome.roofline_s)} ({bound_text(outcome.bound)})"
    return text + (f"; {outcome.message}" if outcome.message else "")


def table_lines(outcomes: Sequence[Outcome], hbm: int) -> list[str]:
    """The candidates as a table: memory per chip, fits, roofline, bound, and the MFU its
    roofline allows counting only the FLOPs of the candidate that runs fewest (the one
    that recomputes least): recomputation is no useful work (`useful_mfu`)."""
    width = max([len(o.candidate.label) for o in outcomes] + [9])
    least = min((o.flops for o in outcomes if o.flops), default=None)
    head = f"  {'candidate':<{width}}  {'HBM/chip':>10}  {'fits':<4}  {'roofline':>9}  bound    MFU"
    lines = [head]
    for o in outcomes:
        label = o.candidate.label
        if o.status in (REFUSED, FAILED):
            lines.append(f"  {label:<{width}}  {o.status}: {o.message}")
            continue
        memory = "-" if o.memory_bytes is None else size_text(o.memory_bytes)
        roof = "-" if o.roofline_s is None else duration_text(o.roofline_s)
        bound = "-" if o.bound is None else bound_text(o.bound)
        useful = useful_mfu(o, least)
        mfu = "-" if useful is None else f"{100 * useful:.0f}%"
        why = f"  ({o.message})" if o.message else ""
        fits = "yes" if o.fits else "no"
        lines.append(
            f"  {label:<{width}}  {memory:>10}  {fits:<4}  {roof:>9}  {bound:<7}  {mfu:>4}{why}"
        )
    lines.append(f"  (the train step, per chip, against {hbm / GiB:.4g} GiB of HBM; MFU: "
                 "the fewest FLOPs of any candidate over roofline x peak)")  # fmt: skip
    return lines


def useful_mfu(outcome: Outcome, least_flops: float | None) -> float | None:
    """The MFU that ``outcome``'s roofline allows counting ``least_flops`` per chip (the
    program that recomputes least) as its work: its MFU ceiling x least / its FLOPs.

    >>> full = Outcome(Candidate((("remat_policy", "full"),)), FITS, mfu_ceiling=1.0, flops=4.0)
    >>> useful_mfu(full, 3.0)  # compute-bound, a quarter of its FLOPs recomputed
    0.75
    """
    if outcome.mfu_ceiling is None or not outcome.flops or not least_flops:
        return outcome.mfu_ceiling
    return outcome.mfu_ceiling * least_flops / outcome.flops


def winner_lines(run: Search, winner: Outcome | None, outcomes: Sequence[Outcome]) -> list[str]:
    """The fastest candidate that fits, with its overrides ready to paste."""
    if winner is None:
        return ["no candidate fits: shard more (mesh fsdp, tensor) or a smaller batch per chip"]
    memory = size_text(winner.memory_bytes)
    roof = f"{duration_text(winner.roofline_s)} ({bound_text(winner.bound)})"
    words = winner.candidate.flags()
    lines = [f"fastest that fits: {winner.candidate.label}: "
             f"{memory} per chip, roofline {roof}"]  # fmt: skip
    lines.append(f"  overrides: {' '.join(words) if words else '(none: the config as given)'}")
    merged = {**run.overrides, **dict(winner.candidate.overrides)}
    slices = ["--slices", str(run.slices)] if run.slices > 1 else []
    python = os.environ.get(
        compiler_env.ASKED_PYTHON
    )  # compile --python: the winner compiles with it too
    command = ["python", "-m", "replicator", "compile", "--config", run.config_file,
               "--topology", run.accelerator, *slices, *(["--python", python] if python else []),
               *(f"--config.{k}={v}" for k, v in merged.items())]  # fmt: skip
    lines.append(f"  compile it: {shlex.join(command)}")
    evals = [o.eval_memory_bytes for o in outcomes if o.eval_memory_bytes is not None]
    if evals:
        lines.append(f"  (the eval step, the same for every candidate: {size_text(evals[0])})")
    return lines


def run_fit(run: Search, workdir: str, hbm: int, print_line: Callable[[str], None]) -> bool:
    """Searches, prints the table and the winner, and writes ``fit/report.json`` in
    ``workdir`` (keyed by the overrides as compile's folder is); whether one fits.

    Args:
      run: the search.
      workdir: where the fit's report goes (local or ``gs://``).
      hbm: a chip's usable HBM in bytes.
      print_line: prints a line of the result.

    Returns:
      Whether a candidate fits.
    """
    log.info(
        "compile --fit: %s for %s%s, %d candidates first, %d at a time (cache %s)",
        run.config_file, run.accelerator, f" x {run.slices}" if run.slices > 1 else "",
        len(first_round(run.config, run.policies)), run.jobs, run.cache_dir,
    )  # fmt: skip
    outcomes = search(run, lambda o, done, total: log.info("%s", outcome_line(o, done, total)))
    winner = fastest(outcomes)
    for line in [*table_lines(outcomes, hbm), *winner_lines(run, winner, outcomes)]:
        print_line(line)
    directory = compile_report.report_dir(workdir, run.overrides, kind="fit")
    path = storage.join(directory, "report.json")
    storage.write_text(path, json.dumps(_fit_json(run, outcomes, winner), indent=2) + "\n")
    print_line(f"report: {path}")
    return winner is not None


def _fit_json(run: Search, outcomes: Sequence[Outcome], winner: Outcome | None) -> dict[str, Any]:
    def row(o: Outcome) -> dict[str, Any]:
        return {**dataclasses.asdict(o), "candidate": dict(o.candidate.overrides)}

    return {
        "config": run.config_file,
        "overrides": run.overrides,
        "topology": run.accelerator,
        "slices": run.slices,
        "candidates": [row(o) for o in outcomes],
        "winner": None if winner is None else row(winner),
        "winner_flags": None if winner is None else winner.candidate.flags(),
    }


def main(
    config: ml_collections.ConfigDict,
    config_file: str,
    overrides: dict[str, str],
    accelerator: str,
    slices: int,
    workdir: str,
    jobs: int | None,
    console: Any,
) -> bool:
    """``compile --fit``: `run_fit` for the command line's config, its log in the fit's
    folder; whether a candidate fits.

    Args:
      config: the config the command line gives (file and overrides).
      config_file: ``--config``'s value, for the children.
      overrides: the command line's ``--config.KEY=VALUE``.
      accelerator: ``--topology``.
      slices: ``--slices``.
      workdir: ``--workdir`` (or compile's default).
      jobs: ``--fit_jobs`` (None: `default_jobs`).
      console: the command's `replicator.trainer.console.Console`.
    """
    from replicator.compiled import topology
    from replicator.trainer.aot import canonical_accelerator

    spec = topology.accelerator(accelerator)
    run = Search(
        config_file, overrides, config, canonical_accelerator(accelerator), slices,
        jobs=jobs or default_jobs(),
    )  # fmt: skip
    lines: list[str] = []
    fits = run_fit(run, workdir, spec.chip.usable_hbm_bytes, lines.append)
    where = compile_report.report_dir(workdir, overrides, kind="fit")
    console.log_to(where, 0, " ".join(sys.argv[1:]), create=True)
    for line in lines:
        console.print(line)
    return fits
