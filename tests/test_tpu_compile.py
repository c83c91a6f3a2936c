"""`python -m replicator compile` for real Cloud TPU topologies, here: libtpu compiles
digits and lm_tiny for v5e-16 and for 2 slices of it, from abstract inputs, no TPU.

The fit line flips with the batch size, the collectives are FSDP's and only the data
axis crosses slices, and the report's memory is the compiler's. `launch tpu` refuses a
run that does not fit. The compiles are skipped where libtpu cannot be imported
(`make install` has it); accelerator names and the chip table are checked anyway.
"""

import copy
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
from replicator.runtime import worker_env
from replicator.trainer import aot
from tests.helpers.configs import load_config

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed here: pip install -e '.[tpu]' (make install does)",
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
THIS_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def report_folder(workdir):
    """The one folder a compile wrote in ``workdir`` (``compile`` or ``compile_<overrides>``)."""
    (folder,) = pathlib.Path(workdir).glob("compile*")
    return folder


def run_cli(*args, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k != "REPLICATOR_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "replicator", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


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
    folder = report_folder(workdir)
    report = json.loads((folder / "report.json").read_text())
    for key in ("topology", "chips", "memory_per_chip_bytes", "hbm_per_chip_bytes", "fits",
                "flops_per_step", "collectives", "roofline_step_s", "shapes",
                "versions"):  # fmt: skip
        assert key in report, key
    assert (report["topology"], report["chips"], report["fits"]) == ("v5e-16", 16, True)
    assert report["flops_per_step"] > 0 and report["roofline_step_s"] > 0
    assert (folder / "train_step.hlo.txt").read_text().startswith("HloModule")
    assert (folder / "eval_step.hlo.txt").is_file()
    assert not [line for line in done.stderr.splitlines() if "TPU_" in line]  # libtpu quiet
    # What was not read, and which compiler: said on the console and in the report.
    assert "the dataset was not read" in report["shapes"] and report["shapes"] in lines
    assert set(report["versions"]) == {"jax", "jaxlib", "libtpu"}
    older = sys.version_info[:2] < tuple(map(int, worker_env.DEFAULT_PYTHON.split(".")))
    said = lines[-3] if older else lines[-2]
    assert said.startswith(f"compiled by jax {report['versions']['jax']}, jaxlib "), said
    if older:  # than the pods' Python: how to compile with their compiler
        # (not in the pre-flight, which compiles with the workers' own: see its test)
        assert f"add --python {worker_env.DEFAULT_PYTHON} to compile as they will" in lines[-2]
    # Progress while it compiles, on stderr: each step's lowering and compile, timed.
    assert "compiling the train step (v5e-16, libtpu): done in " in done.stderr


@needs_libtpu
def test_the_reports_memory_is_the_compilers(digits_report, digits_data_dir):
    """A direct ``jax.jit(...).lower(...).compile()`` of the same step gives the same
    memory analysis, field for field, as the report's."""
    from replicator.trainer.setup import setup

    workdir, _ = digits_report
    report = json.loads((report_folder(workdir) / "report.json").read_text())
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
                   "--workdir", str(tmp_path / "w"), "--python", THIS_PYTHON)  # fmt: skip
    assert done.returncode == 2
    (line,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert line.startswith("error: unknown accelerator type 'v5e-17'; the known ones: ")
    assert "v5litepod-N" in line and not (tmp_path / "w").exists()
    with pytest.raises(TopologyError, match="8 devices"):  # a mesh that does not divide
        compile_lm("v4-16", mesh={"data": 3})


def compile_lm(accelerator, slices=1, stdlib_dir=None, **overrides):
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


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
@needs_libtpu
def test_the_fit_line_flips_with_the_batch_size(stdlib_dir):
    report = compile_lm("v5e-16", stdlib_dir=stdlib_dir, batch_size=2**21)  # 16 fits
    assert not report.fits and not report.train.fits
    hbm = report.hbm_per_chip_bytes
    assert report.train.total_bytes > hbm
    assert aot.fit_text(report.train.total_bytes, hbm).startswith("does not fit by ")
    # XLA's own out-of-memory message is the train step's, and printed under it.
    lines = aot.summary_lines(report)
    oom = [i for i, line in enumerate(lines) if line.startswith("  note: XLA ran out of memory")]
    assert oom and oom[0] < lines.index("eval step, per chip:")


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
    config = load_config("lm_tiny", data_dir=stdlib_dir, pack_documents=True, step_path="compile")
    aot.compile_for_topology(config, "v5e-4", workdir=str(tmp_path))
    hlo = {s: (tmp_path / "compile" / f"{s}_step.hlo.txt").read_text() for s in ("train", "eval")}
    # Pallas names the kernels that take SegmentIds so: forward, and the train step's backward.
    assert "splash_mha_fwd_segmented" in hlo["eval"]
    assert all(f"splash_mha_{k}_segmented" in hlo["train"] for k in ("fwd", "dq", "dkv"))


def preflight(tmp_path, *overrides):
    """``launch tpu --dry-run`` of the pods page's digits example for a v5litepod-16, its
    data and workdir in a bucket this machine cannot reach (a closed port stands in for
    the storage service: any request would fail at once)."""
    train = ["train", "--config", "configs/digits_cnn.py", "--workdir", "gs://my-bucket/run",
             "--config.data_dir=gs://my-bucket/tfds", *overrides]  # fmt: skip
    where = [
        "launch",
        "tpu",
        "--tpu",
        "my-pod",
        "--zone",
        "z",
        "--python",
        THIS_PYTHON,
        "--dry-run",
    ]  # this Python compiles: no other environment made
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "STORAGE_EMULATOR_HOST": "http://127.0.0.1:9"}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "replicator", *where, "--accelerator-type", "v5litepod-16",
         "--", *train],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@needs_libtpu
def test_the_preflight_needs_no_bucket_and_says_what_it_checked(tmp_path):
    done = preflight(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("# pre-flight: python -m replicator compile --config ")
    (said,) = [line for line in done.stdout.splitlines() if line.startswith("# pre-flight: fits")]
    assert "to compile as they will" not in done.stdout  # it compiles as the workers run
    assert "shapes from the metadata of digits (tfds features); the dataset was not read" in said
    versions = aot.compiler_versions()
    assert said.endswith(f"compiled by jax {versions['jax']}, jaxlib {versions['jaxlib']}, "
                         f"libtpu {versions['libtpu']}")  # fmt: skip
    # ... and the workers install that compiler: the environment pins it.
    pins = f"jax=={versions['jax']} jaxlib=={versions['jaxlib']} libtpu=={versions['libtpu']}"
    assert f'printf "%s\\n" {pins} > "$env/pins.txt"' in done.stdout


@pytest.mark.slow  # the pre-flight's sibling above stays fast
@needs_libtpu
def test_launch_tpu_refuses_a_run_that_does_not_fit(tmp_path):
    done = preflight(tmp_path, "--config.batch_size=16777216")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stdout.startswith("# pre-flight: python -m replicator compile --config ")
    assert "does not fit by" in done.stdout and "gcloud compute tpus" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the run does not fit v5litepod-16") and "--no-preflight" in last
    folder = report_folder(tmp_path / "cache" / "replicator" / "preflight" / "my-pod")
    assert json.loads((folder / "report.json").read_text())["fits"] is False


# ---------------------------------------------------------------- the command's own seams


def step_report(total, notes=()):
    from replicator.trainer.compile_report import StepReport

    return StepReport({}, {"temporaries": total}, total, total < 2**30, notes=list(notes))


def test_a_note_is_printed_under_the_step_it_belongs_to():
    from replicator.trainer.compile_report import CompileReport, summary_lines

    oom = "XLA ran out of memory: RESOURCE_EXHAUSTED: Ran out of memory on HBM"
    report = CompileReport(
        "v5e-16", 1, 16, "TPU v5e", {"fsdp": 16}, None, 2**30,
        step_report(2**31, [oom]), step_report(2**20, ["eval's own note"]),
        {"jax": "0.10.2", "libtpu": "0.0.42.1"},
    )  # fmt: skip
    lines = summary_lines(report)
    train, evaluate = lines.index("train step, per chip:"), lines.index("eval step, per chip:")
    assert train < lines.index(f"  note: {oom}") < evaluate
    assert lines.index("  note: eval's own note") > evaluate
    assert "compiled by jax 0.10.2, libtpu 0.0.42.1" in lines
    assert not report.fits and lines[-1].startswith("to fit: ")


def test_a_compile_replaces_its_folder_whole(tmp_path):
    """The same overrides again: the earlier compile's files go, its HLO of a step not
    compiled now included; other overrides keep their own folder."""
    from replicator.trainer.compile_report import CompileReport, report_dir, write_report

    def report(overrides, evaluate):
        return CompileReport("v5e-4", 1, 4, "TPU v5e", {"data": 4}, None, 2**34,
                             step_report(1), step_report(1) if evaluate else None, {},
                             overrides=overrides)  # fmt: skip

    minimal = report_dir(str(tmp_path), {"remat_policy": "minimal"})
    write_report(report({"remat_policy": "minimal"}, True), {"train": "A", "eval": "B"}, minimal)
    pathlib.Path(minimal, "log.txt").write_text("the first compile's log\n")
    full = report_dir(str(tmp_path), {"remat_policy": "full"})
    write_report(report({"remat_policy": "full"}, True), {"train": "C", "eval": "D"}, full)
    write_report(report({"remat_policy": "minimal"}, False), {"train": "E"}, minimal)
    assert sorted(os.listdir(minimal)) == ["report.json", "train_step.hlo.txt"]
    assert pathlib.Path(minimal, "train_step.hlo.txt").read_text() == "E"
    assert json.loads(pathlib.Path(minimal, "report.json").read_text())["eval_step"] is None
    assert sorted(os.listdir(full)) == ["eval_step.hlo.txt", "report.json", "train_step.hlo.txt"]
    assert os.path.basename(minimal) == "compile_remat_policy=minimal"


def test_a_long_compile_says_it_is_still_going(caplog):
    import time

    with caplog.at_level("INFO", logger="replicator"):
        with aot.progress("compiling the train step", every_s=0.05):
            time.sleep(0.3)
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == "  compiling the train step ..."
    assert len([s for s in said if s.endswith("s so far")]) >= 2
    assert said[-1].startswith("  compiling the train step: done in ")


@pytest.mark.parametrize("dataset", ["digits", "python_stdlib/modules_128"])
def test_the_metadatas_example_is_shaped_as_the_datas(dataset, digits_data_dir, stdlib_dir):
    import jax
    import numpy as np

    import experiments.lm  # noqa: F401  (registers python_stdlib)
    from replicator.trainer import data
    from replicator.trainer.data import metadata

    data_dir = digits_data_dir if dataset == "digits" else stdlib_dir
    read = data.load_data_source(dataset, "test", data_dir=data_dir)[0]
    for where in (data_dir, "gs://no-such-bucket/tfds"):  # prepared here; its code's
        shaped = metadata.example_from_metadata(dataset, where)
        assert jax.tree.map(lambda x: (np.shape(x), np.asarray(x).dtype), shaped.example) == (
            jax.tree.map(lambda x: (np.shape(x), np.asarray(x).dtype), read)
        )


def test_a_dataset_without_fixed_shapes_is_read_and_says_so():
    from replicator.trainer.data import metadata

    shaped = metadata.example_from_metadata("imagenet2012", "gs://no-such-bucket/tfds")
    assert shaped.example is None and "no fixed shape to image (None, None, 3)" in shaped.how
    assert metadata.example_from_metadata("no_such_dataset_at_all").example is None


@pytest.mark.slow  # three compiles through the command line (about 25 s each)
@needs_libtpu
def test_two_compiles_with_other_overrides_keep_a_complete_folder_each(tmp_path):
    workdir = tmp_path / "w"

    def compile_digits(*args):
        done = run_cli("compile", "--config", "configs/digits_cnn.py", "--topology", "V5E-16",
                       "--workdir", str(workdir), "--config.step_path=compile", *args)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    compile_digits("--config.batch_size=32")
    compile_digits("--config.batch_size=64")
    compile_digits("--config.batch_size=64", "--steps=train")  # the same folder, whole again
    folders = sorted(p.name for p in workdir.iterdir())
    assert folders == ["compile_batch_size=32,step_path=compile",
                       "compile_batch_size=64,step_path=compile"]  # fmt: skip
    for folder, rows, steps in ((folders[0], 2, ["eval", "train"]), (folders[1], 4, ["train"])):
        files = sorted(os.listdir(workdir / folder))
        assert files == sorted(["log.txt", "report.json", *(f"{s}_step.hlo.txt" for s in steps)])
        report = json.loads((workdir / folder / "report.json").read_text())
        assert report["overrides"] == {"batch_size": str(rows * 16), "step_path": "compile"}
        assert report["topology"] == "v5e-16"
        # The program beside the report is the report's: its batch of `rows` per chip.
        program = (workdir / folder / "train_step.hlo.txt").read_text()
        assert f"[{rows},8,8,1]" in program and f"[{6 - rows},8,8,1]" not in program
        assert (workdir / folder / "log.txt").read_text().count("==== ") == 1


def test_the_workers_pin_the_compiler_that_compiled_here():
    from replicator.runtime import worker_env
    from replicator.runtime.bundle import Bundle

    env = worker_env.plan_environment(ROOT, "3.11")
    versions = aot.compiler_versions() if importlib.util.find_spec("libtpu") else {}
    assert env.pins == tuple(f"{k}=={v}" for k, v in versions.items())
    if not env.pins:
        return
    unpinned = worker_env.Environment(env.python, env.requirements, env.wheels)
    assert env.digest != unpinned.digest  # another compiler here: another environment there
    bundle = Bundle({}, "project", (), "0" * 12)
    script = worker_env.setup_script(bundle, env).splitlines()
    pins = [line.strip() for line in script if "pins.txt" in line]
    assert pins == [f'printf "%s\\n" {" ".join(env.pins)} > "$env/pins.txt"',
                    'export UV_CONSTRAINT="$env/pins.txt"']  # fmt: skip
    said = worker_env.describe_environment(env)
    assert "pinned to the compiler that checks it here: jax " in said


@pytest.mark.slow  # uv installs the project's dependencies afresh (minutes with a cold cache)
@needs_libtpu
def test_a_compile_in_an_environment_made_by_uv_reports_its_compiler(tmp_path):
    """`compile --python` and the pre-flight run the compile in an environment uv makes
    (here of this Python, in a folder of the test's): the report's compiler is that
    environment's, which is what the workers are pinned to."""
    from replicator.runtime import compiler_env

    env = compiler_env.environment(THIS_PYTHON)
    made = compiler_env.make_environment(env, tmp_path / "env", ROOT)
    interpreter = str(made / "bin" / "python")
    assert (made / "installed").is_file() and interpreter != sys.executable
    pins = compiler_env.pins(interpreter)
    assert [p.split("==")[0] for p in pins] == ["jax", "jaxlib", "libtpu"]
    workdir = tmp_path / "w"
    args = ["compile", "--config", "configs/digits_cnn.py", "--topology", "v5e-4", "--steps",
            "train", "--workdir", str(workdir)]  # fmt: skip
    assert compiler_env.run(interpreter, args) == 0
    report = json.loads((report_folder(workdir) / "report.json").read_text())
    assert tuple(f"{k}=={v}" for k, v in report["versions"].items()) == pins


def hf_llama_dir(root, **config):
    """A Hugging Face Llama checkpoint's directory in which only config.json is sound: its
    weights and tokenizer are not what they claim to be, so reading either would fail."""
    root.mkdir()
    shape = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 96,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 128, "tie_word_embeddings": False, **config}  # fmt: skip
    (root / "config.json").write_text(json.dumps(shape))
    (root / "model.safetensors").write_bytes(b"\xff" * 64)  # no safetensors header
    (root / "tokenizer.json").write_text("{ not a tokenizer")
    return root


def test_the_compiles_model_shape_comes_from_config_json_or_else_the_config(tmp_path):
    ckpt = hf_llama_dir(tmp_path / "ckpt")
    config = load_config("llama3_8b", init_from=f"hf:{ckpt}")
    assert config.model.mlp_dim == 64
    shaped, words = aot.checkpoint_shape(config)
    assert shaped.model.mlp_dim == 96  # the checkpoint's intermediate_size
    assert words == f"init_from hf:{ckpt}: the model's shape from its config.json; no weights read"
    gone = load_config("llama3_8b", init_from="hf:/no/such/ckpt", tokenizer="/no/such/tok.json")
    shaped, words = aot.checkpoint_shape(gone)  # the pod's disk: config.model stands
    assert shaped.model.to_dict() == gone.model.to_dict()
    assert words.startswith("init_from hf:/no/such/ckpt: not on this machine")
    assert words.endswith("no weights read; config.tokenizer=/no/such/tok.json not read")


@needs_libtpu
def test_a_compile_reads_no_weights_and_no_tokenizer(tmp_path):
    """init_from a checkpoint whose weight file and tokenizer cannot be parsed: the
    compile reads config.json alone and says so, in the report and on the console."""
    ckpt = hf_llama_dir(tmp_path / "ckpt")
    done = run_cli(
        "compile", "--config", "configs/llama3_8b.py:smoke", "--topology", "v5e-4",
        "--steps", "train", "--workdir", str(tmp_path / "w"),
        f"--config.init_from=hf:{ckpt}", f"--config.tokenizer={ckpt}/tokenizer.json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((report_folder(tmp_path / "w") / "report.json").read_text())
    said = f"no weights read; config.tokenizer={ckpt}/tokenizer.json not read"
    assert report["shapes"].endswith(said) and said in done.stdout
    assert report["train_step"]["fits"]
