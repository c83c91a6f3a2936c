"""``compile --fit`` (replicator/trainer/fit.py): the fastest program that fits, by compiling.

The rounds' logic is checked on outcomes made by hand; the search itself compiles
lm_tiny's candidates for a v5e-4 in child processes (libtpu, no TPU): a table of
each, a crash reported as a candidate that does not fit, a rerun read from the
cache, and the winner's overrides compiling to the figures the table shows.
"""

import copy
import importlib.util
import os
import pathlib

import pytest

from replicator.trainer import fit
from replicator.trainer.fit import DOES_NOT_FIT, FAILED, FITS, REFUSED, Candidate, Outcome
from tests.test_tpu_compile import ROOT, load_config, needs_libtpu


def outcome(status, roofline, *overrides, memory=2**30):
    return Outcome(Candidate(tuple(overrides)), status, memory, roofline, "hbm")


def test_the_fastest_that_fits_wins_and_ties_go_to_less_memory_in_hbm():
    outcomes = [
        outcome(FITS, 0.303, ("remat_policy", "full"), memory=2**29),  # 1.3% slower
        outcome(
            FITS, 0.2995, ("remat_policy", "minimal"), ("grad_accum_steps", "2"), memory=2**30
        ),  # fmt: skip
        outcome(FITS, 0.2990, memory=2**31),  # as given, fastest, but twice the memory
        outcome(FITS, 0.2990, ("offload_optimizer_state", "True"), memory=2**28),
        outcome(DOES_NOT_FIT, 0.100, ("remat_policy", "None")),
    ]
    # Within 1% of the fastest: the least memory, but not by moving state to the host
    # (what crosses PCIe is not in the roofline).
    assert fit.fastest(outcomes) is outcomes[1]
    assert fit.fastest(outcomes[4:]) is None
    same = [outcome(FITS, 0.3), outcome(FITS, 0.3, ("remat_policy", "minimal"))]
    assert fit.fastest(same) is same[0]  # equal in all else: fewer overrides


def test_the_tables_mfu_counts_recomputed_flops_as_no_work():
    """Two compute-bound candidates: the MFU column is not 100% for both; the one that
    recomputes a quarter of its FLOPs (remat full) shows that quarter lost."""
    none = Outcome(Candidate((("remat_policy", "None"),)), FITS, 2**30, 0.3, "compute", 1.0,
                   flops=3e12)  # fmt: skip
    full = Outcome(Candidate((("remat_policy", "full"),)), FITS, 2**29, 0.4, "compute", 1.0,
                   flops=4e12)  # fmt: skip
    crashed = outcome(DOES_NOT_FIT, None, ("remat_policy", "minimal"))
    rows = fit.table_lines([none, full, crashed], hbm=2**34)[1:4]
    assert [row.split()[-1] for row in rows] == ["100%", "75%", "-"]


def test_the_second_round_splits_what_could_beat_or_equal_the_fastest_that_fits():
    config = load_config("lm_tiny", step_path="compile", batch_size=32)
    outcomes = [
        outcome(FITS, 0.300, ("remat_policy", "full")),
        outcome(DOES_NOT_FIT, 0.200, ("remat_policy", "minimal")),  # faster: split it
        outcome(DOES_NOT_FIT, 0.400, ("remat_policy", "save_qkv_proj")),  # slower: no
        outcome(DOES_NOT_FIT, None, ("remat_policy", "None")),  # crashed: unknown, try
        outcome(REFUSED, None, ("remat_policy", "minimal_offloaded")),
        outcome(FAILED, None, ("remat_policy", "save_dot_except_mlp")),
    ]
    found = [c.label for c in fit.second_round(config, outcomes, devices=8)]
    assert found == [
        "remat_policy=full grad_accum_steps=2",  # the fastest that fits: in less memory?
        "remat_policy=full grad_accum_steps=4",
        "remat_policy=minimal grad_accum_steps=2",  # 32 rows over 8 devices: 4 per device
        "remat_policy=minimal grad_accum_steps=4",
        "remat_policy=minimal offload_optimizer_state=True",
        "remat_policy=None grad_accum_steps=2",
        "remat_policy=None grad_accum_steps=4",
        "remat_policy=None offload_optimizer_state=True",
    ]
    # A batch of 2 rows per device splits in 2 only; step_path='run' cannot offload.
    config.update(batch_size=16, step_path="run")
    found = [c.label for c in fit.second_round(config, outcomes[:2], devices=8)]
    assert found == [
        "remat_policy=full grad_accum_steps=2",
        "remat_policy=minimal grad_accum_steps=2",
    ]


def test_the_first_round_is_every_policy_the_configs_own_first():
    config = load_config("lm_tiny", remat_policy="minimal", grad_accum_steps=2)
    labels = [c.label for c in fit.first_round(config)]
    assert labels[0] == "remat_policy=minimal grad_accum_steps=2 (as given)"
    assert labels[1:] == [
        "remat_policy=None",
        "remat_policy=full",
        "remat_policy=minimal_with_context",
        "remat_policy=save_dot_except_mlp",
        "remat_policy=save_qkv_proj",
        "remat_policy=minimal_offloaded",
    ]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """lm_tiny (smoke) on a v5e-4: as given, full, minimal and save_qkv_proj, whose
    compile kills itself with SIGSEGV (what libtpu can do with a far-too-large program),
    searched twice into one cache. One row per chip: no second round (no microbatches
    to split into; `step_path='run'` keeps the optimizer state in HBM)."""
    cache = str(tmp_path_factory.mktemp("fit_cache"))
    config = load_config("lm_tiny", batch_size=4)
    assert config.step_path == "run"
    run = fit.Search(
        "configs/lm_tiny.py:smoke", {"batch_size": "4"}, config, "v5e-4", cache_dir=cache,
        jobs=2, policies=("full", "minimal", "save_qkv_proj"),
    )  # fmt: skip
    before = dict(os.environ)
    os.environ["REPLICATOR_SIMULATE_SIGSEGV"] = "remat_policy=save_qkv_proj"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        seen = []
        first = fit.search(run, lambda o, done, total: seen.append((o, done, total)))
        logs = {p: p.stat().st_mtime_ns for p in pathlib.Path(cache).glob("*/child.log")}
        again = fit.search(run, lambda *_: None)
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(before)
    return run, first, again, seen, logs


@pytest.mark.slow  # four compiles in child processes (about 40 s each on 2 loaded cores)
@needs_libtpu
def test_a_search_tables_every_candidate_and_reports_a_crash(searched, monkeypatch):
    run, outcomes, _, seen, _ = searched
    labels = [o.candidate.label for o in outcomes]
    assert labels == [
        "remat_policy=None (as given)",
        "remat_policy=full",
        "remat_policy=minimal",
        "remat_policy=save_qkv_proj",
    ]
    assert sorted(done for _, done, _ in seen) == [1, 2, 3, 4] and {t for *_, t in seen} == {4}
    crashed = outcomes[3]
    assert crashed.status == DOES_NOT_FIT and crashed.message == "the compiler crashed (SIGSEGV)"
    assert all(o.fits and o.memory_bytes > 0 and o.roofline_s > 0 for o in outcomes[:3])
    assert outcomes[0].eval_memory_bytes > 0  # the eval step, once
    table = fit.table_lines(outcomes, 15 * 2**30)
    assert all(any(line.strip().startswith(label) for line in table) for label in labels)
    assert "the compiler crashed (SIGSEGV)" in table[4]
    winner = fit.fastest(outcomes)
    lines = fit.winner_lines(run, winner, outcomes)
    assert lines[0].startswith(f"fastest that fits: {winner.candidate.label}: ")
    assert lines[2].startswith("  compile it: python -m replicator compile --config ")
    # A search run by `compile --python 3.12` names that Python in the winner's command.
    from replicator.runtime import compiler_env

    monkeypatch.setenv(compiler_env.ASKED_PYTHON, "3.12")
    assert " --python 3.12 " in fit.winner_lines(run, winner, outcomes)[2]


@pytest.mark.slow
@needs_libtpu
def test_a_rerun_reads_the_cache_and_compiles_nothing(searched):
    _, first, again, _, logs = searched
    assert all(o.cached and o.seconds == 0 for o in again)
    fields = ("status", "memory_bytes", "roofline_s", "bound", "message", "eval_memory_bytes")
    assert [[getattr(o, f) for f in fields] for o in again] == [
        [getattr(o, f) for f in fields] for o in first
    ]
    assert len(logs) == 4  # a child each, the first time
    assert {p: p.stat().st_mtime_ns for p in logs} == logs  # none ran again


@pytest.mark.slow
@needs_libtpu
def test_the_winners_overrides_compile_to_the_figures_of_the_table(searched):
    """The winner's overrides (and another candidate's), pasted onto the config, compile
    to the memory and roofline its row shows."""
    from replicator.trainer import aot

    run, outcomes, *_ = searched
    winner = fit.fastest(outcomes)
    other = next(o for o in outcomes if o.candidate.overrides and o.fits and o is not winner)
    for chosen in (winner, other):
        config = copy.deepcopy(run.config)
        config.update({k: None if v == "None" else v for k, v in chosen.candidate.overrides})
        report = aot.compile_for_topology(config, "v5e-4", steps=("train",))
        assert report.train.total_bytes == chosen.memory_bytes, chosen.candidate.label
        assert report.train.roofline["step_s"] == pytest.approx(chosen.roofline_s, rel=1e-9)
        assert report.eval is None and report.train.fits


def test_the_cache_key_moves_with_what_the_program_depends_on(monkeypatch):
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed here")
    config = load_config("lm_tiny")
    monkeypatch.chdir(ROOT)
    run = fit.Search("configs/lm_tiny.py:smoke", {}, config, "v5e-4", cache_dir="/unused")
    key = fit.cache_key(run, Candidate((("remat_policy", "full"),)), False)
    assert key == fit.cache_key(run, Candidate((("remat_policy", "full"),)), False)
    others = [
        fit.cache_key(run, Candidate((("remat_policy", "minimal"),)), False),
        fit.cache_key(run, Candidate((("remat_policy", "full"),)), True),
        fit.cache_key(
            fit.Search("configs/lm_tiny.py", {}, config, "v5e-4", "/u"),
            Candidate((("remat_policy", "full"),)),
            False,
        ),  # fmt: skip
        fit.cache_key(
            fit.Search("configs/lm_tiny.py:smoke", {}, config, "v5e-8", "/u"),
            Candidate((("remat_policy", "full"),)),
            False,
        ),  # fmt: skip
    ]
    assert len({key, *others}) == 5
    from replicator.trainer import aot

    monkeypatch.setattr(aot, "compiler_versions", lambda: {"jax": "0.0.1"})
    assert fit.cache_key(run, Candidate((("remat_policy", "full"),)), False) != key
