"""`python -m replicator compile` for real Cloud TPU topologies, here: libtpu compiles
digits and lm_tiny for v5e-16 and for 2 slices of it, from abstract inputs, no TPU.

The fit line flips with the batch size, the collectives are FSDP's and only the data
axis crosses slices, and the report's memory is the compiler's. `launch tpu` refuses a
run that does not fit. The compiles are skipped where libtpu cannot be imported
(`make install` has it); accelerator names and the chip table are checked anyway.
"""

import copy
import doctest
import importlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from replicator.compiled import topology as topology
from replicator.errors import TopologyError

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed here: pip install -e '.[tpu]' (make install does)",
)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_config(name, mode="smoke", **overrides):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(mode)
    config.update(overrides)
    return config


def run_cli(*args, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k != "REPLICATOR_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "replicator", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("module", ["replicator.compiled.topology", "replicator.trainer.aot",
                                    "replicator.trainer.peaks"])  # fmt: skip
def test_the_doctests(module):
    assert doctest.testmod(importlib.import_module(module)).failed == 0


@pytest.mark.parametrize(
    "name, topology_name, chips, bounds",
    [  # as MaxText's accelerator_to_spec_map.py lays them out
        ("v4-32", "v4:2x2x4", 16, (2, 2, 1)),
        ("v5p-128", "v5:4x4x4", 64, (2, 2, 1)),
        ("v5p-1536", "v5:8x8x12", 768, (2, 2, 1)),
        ("v5p-13824", "v5:12x24x24", 6912, (2, 2, 1)),
        ("v5e-1", "v5e:1x1", 1, (1, 1, 1)),
        ("v5litepod-16", "v5e:4x4", 16, (2, 2, 1)),
        ("v5e-128", "v5e:8x16", 128, (2, 2, 1)),
        ("v6e-8", "v6e:2x4", 8, (2, 2, 1)),
        ("tpu7x-8", "tpu7x:2x2x1", 4, (2, 2, 1)),
    ],
)
def test_accelerator_names_map_to_libtpu_topologies(name, topology_name, chips, bounds):
    spec = topology.accelerator(name)
    assert (spec.topology, spec.chips, spec.chips_per_host_bounds) == (topology_name, chips, bounds)
    for bad in ("v5e-2", "v5p-96", "v3-8", "v5e", "gpu-8"):
        with pytest.raises(TopologyError, match=f"unknown accelerator type '{bad}'"):
            topology.accelerator(bad)


def test_every_tpu_in_the_chip_table_says_where_its_numbers_come_from():
    for chip in topology.CHIPS:
        assert chip.source and chip.bf16_flops_per_s, chip.name
        if chip.name.startswith("TPU"):
            assert chip.source.startswith("https://cloud.google.com/tpu/docs/"), chip.name
            assert chip.hbm_bytes > 0 and chip.usable_hbm_bytes > 0, chip.name
    assert topology.chip_spec("TPU v5 lite").name == "TPU v5e"
    assert topology.chip_spec("TPU v5").name == "TPU v5p"


@needs_libtpu
def test_a_replicator_over_two_slices_lays_its_mesh_out_as_the_pod():
    import replicator as rp

    devices = rp.topology.devices("v5e-16", slices=2)
    assert len(devices) == 32 and {d.device_kind for d in devices} == {"TPU v5 lite"}
    repl = rp.Replicator(devices=devices, mesh={"fsdp": -1}, dcn_mesh={"data": 2})
    grid = repl.mesh.devices
    assert grid.shape == (2, 16, 1)
    assert [{d.slice_index for d in grid[i].flat} for i in range(2)] == [{0}, {1}]
    one = rp.Replicator(devices=rp.topology.devices("v5e-16"), mesh={"fsdp": -1}).mesh.devices
    # Along fsdp each chip's neighbour is one ICI hop away: a ring through the 4x4 slice,
    # not the device list's order (whose 2x2 host blocks a plain reshape would follow).
    for row in [*grid[:, :, 0], one[0, :, 0]]:
        hops = [sum(abs(a - b) for a, b in zip(x.coords, y.coords)) for x, y in zip(row, row[1:])]
        assert hops == [1] * 15, hops


@pytest.fixture(scope="module")
def stdlib_dir(tmp_path_factory):
    """A data_dir with lm_tiny's corpus (the standard library's modules), built once."""
    import experiments.lm  # noqa: F401  (registers the python_stdlib builder)
    from replicator.trainer import data

    path = str(tmp_path_factory.mktemp("stdlib"))
    data.load_data_source("python_stdlib/modules_128", "test", data_dir=path)
    return path


@pytest.fixture(scope="module")
def digits_report(tmp_path_factory, digits_data_dir):
    """digits on v5e-16 through the command line, on the global-view path."""
    workdir = tmp_path_factory.mktemp("digits") / "run"
    done = run_cli(
        "compile", "--config", "configs/digits_cnn.py", "--topology", "v5e-16",
        "--workdir", str(workdir), f"--config.data_dir={digits_data_dir}",
        "--config.step_path=compile",
    )  # fmt: skip
    return workdir, done


@needs_libtpu
def test_digits_compiles_for_v5e_16_from_the_command_line(digits_report):
    workdir, done = digits_report
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("v5e-16: 16 chips of TPU v5e, 15.75 GiB of HBM each; mesh data=16")
    total = next(line for line in lines if line.lstrip().startswith("total"))  # train step's
    assert "fits, " in total and "of 15.75 GiB" in total
    assert any("all-reduce" in line and "over data" in line and "ICI" in line for line in lines)
    assert any(line.lstrip().startswith("roofline") and "MFU ceiling" in line for line in lines)
    report = json.loads((workdir / "compile" / "report.json").read_text())
    for key in ("topology", "chips", "memory_per_chip_bytes", "hbm_per_chip_bytes", "fits",
                "flops_per_step", "collectives", "roofline_step_s"):  # fmt: skip
        assert key in report, key
    assert (report["topology"], report["chips"], report["fits"]) == ("v5e-16", 16, True)
    assert report["flops_per_step"] > 0 and report["roofline_step_s"] > 0
    assert (workdir / "compile" / "train_step.hlo.txt").read_text().startswith("HloModule")
    assert (workdir / "compile" / "eval_step.hlo.txt").is_file()
    assert not [line for line in done.stderr.splitlines() if "TPU_" in line]  # libtpu quiet


@needs_libtpu
def test_the_reports_memory_is_the_compilers(digits_report, digits_data_dir):
    """A direct ``jax.jit(...).lower(...).compile()`` of the same step gives the same
    memory analysis, field for field, as the report's."""
    from replicator.trainer import aot
    from replicator.trainer.setup import setup

    workdir, _ = digits_report
    report = json.loads((workdir / "compile" / "report.json").read_text())
    config = load_config("digits_cnn", "", data_dir=digits_data_dir, step_path="compile")
    run = setup(config, devices=topology.devices("v5e-16"))
    try:
        train_batch, _ = aot.abstract_batches(run)
        run.train_step.lower(run.abstract_state, train_batch)  # settles the jit in use
        direct = run.train_step.jitted.lower(run.abstract_state, train_batch).compile()
    finally:
        run.close()
    memory = aot.memory_fields(direct.memory_analysis())
    assert report["train_step"]["memory"] == memory
    assert report["train_step"]["total_bytes"] == aot.total_bytes(memory)
    assert report["memory_per_chip_bytes"] >= aot.total_bytes(memory)


@needs_libtpu
def test_an_unknown_accelerator_is_one_line(tmp_path):
    done = run_cli("compile", "--config", "configs/digits_cnn.py", "--topology", "v5e-17",
                   "--workdir", str(tmp_path / "w"))  # fmt: skip
    assert done.returncode == 2
    (line,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert line.startswith("error: unknown accelerator type 'v5e-17'; the known ones: ")
    assert "v5litepod-N" in line and not (tmp_path / "w").exists()
    with pytest.raises(TopologyError, match="8 devices"):  # a mesh that does not divide
        compile_lm("v4-16", mesh={"data": 3})


def compile_lm(accelerator, slices=1, stdlib_dir=None, **overrides):
    from replicator.trainer import aot

    config = load_config("lm_tiny", data_dir=stdlib_dir, **overrides)
    return aot.compile_for_topology(copy.deepcopy(config), accelerator, slices=slices)


@needs_libtpu
def test_lm_tiny_on_v5e_16_gathers_and_reduces_over_fsdp(stdlib_dir):
    # fsdp_min_size=0: the smoke model's small parameters are sharded too.
    report = compile_lm("v5e-16", stdlib_dir=stdlib_dir, fsdp_min_size=0)
    assert report.fits and report.mesh == {"data": 1, "fsdp": 16, "tensor": 1}
    every_step = [c for c in report.train.collectives if not c["in_branch"]]
    kinds = {(c["kind"], tuple(c["axes"]), c["dcn"]) for c in every_step}
    assert ("all-gather", ("fsdp",), False) in kinds  # parameters gathered for the step
    reduced = {k for k in kinds if k[0] in ("reduce-scatter", "all-reduce")}
    assert reduced and all(axes == ("fsdp",) and not dcn for _, axes, dcn in reduced)
    assert report.train.flops > 0 and report.train.roofline["step_s"] > 0


@needs_libtpu
def test_the_fit_line_flips_with_the_batch_size(stdlib_dir):
    from replicator.trainer import aot

    report = compile_lm("v5e-16", stdlib_dir=stdlib_dir, batch_size=2**21)  # 16 fits
    assert not report.fits and not report.train.fits
    hbm = report.hbm_per_chip_bytes
    assert report.train.total_bytes > hbm
    assert aot.fit_text(report.train.total_bytes, hbm).startswith("does not fit by ")


@needs_libtpu
def test_two_slices_send_only_the_data_axis_across_them(stdlib_dir):
    report = compile_lm("v5e-16", slices=2, stdlib_dir=stdlib_dir, batch_size=32)
    assert report.chips == 32 and report.dcn_mesh == {"data": 2}
    assert report.mesh == {"data": 2, "fsdp": 16, "tensor": 1}
    dcn = [c for c in report.train.collectives if c["dcn"]]
    ici = [c for c in report.train.collectives if not c["dcn"]]
    assert dcn and all(tuple(c["axes"]) == ("data",) for c in dcn)
    assert ici and all("data" not in c["axes"] for c in ici)
    assert report.train.roofline["dcn_s"] > 0


@pytest.mark.slow  # 20 s: tests/test_packing.py compiles segmented splash alone on every run
@needs_libtpu
def test_packed_documents_compile_to_segmented_splash_on_a_tpu(stdlib_dir, tmp_path):
    from replicator.trainer import aot

    config = load_config("lm_tiny", data_dir=stdlib_dir, pack_documents=True, step_path="compile")
    aot.compile_for_topology(config, "v5e-4", workdir=str(tmp_path))
    hlo = {s: (tmp_path / "compile" / f"{s}_step.hlo.txt").read_text() for s in ("train", "eval")}
    # Pallas names the kernels that take SegmentIds so: forward, and the train step's backward.
    assert "splash_mha_fwd_segmented" in hlo["eval"]
    assert all(f"splash_mha_{k}_segmented" in hlo["train"] for k in ("fwd", "dq", "dkv"))


@needs_libtpu
def test_launch_tpu_refuses_a_run_that_does_not_fit(tmp_path, digits_data_dir):
    train = ["train", "--config", "configs/digits_cnn.py", "--workdir", "gs://bucket/run",
             f"--config.data_dir={digits_data_dir}"]  # fmt: skip
    where = ["launch", "tpu", "--tpu", "my-pod", "--zone", "z", "--dry-run"]
    where.append("--allow-local-workdir")  # the local data_dir: the pre-flight is tested here
    env_home = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "replicator", *where, "--accelerator-type", "v5litepod-16",
         "--", *train, "--config.batch_size=16777216"],
        cwd=ROOT, env={**os.environ, **env_home}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stdout.startswith("# pre-flight: python -m replicator compile --config ")
    assert "does not fit by" in done.stdout and "gcloud compute tpus" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the run does not fit v5litepod-16") and "--no-preflight" in last
    report = tmp_path / "cache" / "replicator" / "preflight" / "my-pod" / "compile" / "report.json"
    assert json.loads(report.read_text())["fits"] is False
