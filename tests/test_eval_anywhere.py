"""Eval anywhere: a run trained on 8 devices evaluates on 1 or 3, with the same numbers.

The saved mesh is refitted to the devices there are (`replicator.parallel.mesh.refit_axis_sizes`):
the data axis (or the axis saved as -1) absorbs the difference, sharded axes keep
what still divides. Training keeps asking for exactly its mesh.
"""

import json
import logging

import pytest

from replicator.parallel.mesh import MESH_AXES, refit_axis_sizes
from replicator.trainer.setup import _eval_mesh
from tests.helpers.cli import assert_one_line_error, lines, run_cli
from tests.helpers.configs import read_records

# ---- The refit, alone


@pytest.mark.parametrize(
    "saved, num_devices, expected",
    [
        ({"data": 8}, 3, (3, 1, 1)),
        ({"data": 8}, 1, (1, 1, 1)),
        ({"data": 4, "fsdp": 2}, 3, (3, 1, 1)),  # fixed fsdp=2 does not divide 3
        ({"data": 4, "fsdp": 2}, 6, (3, 2, 1)),  # ... but divides 6: kept
        ({"data": 2, "fsdp": 2, "tensor": 2}, 1, (1, 1, 1)),  # tensor=2 onto 1
        ({"tensor": 4, "data": 2}, 6, (3, 1, 2)),  # the part of tensor that divides
        ({"data": -1, "tensor": 2}, 3, (3, 1, 1)),  # -1 on data
        ({"data": 1, "fsdp": -1, "tensor": 2}, 3, (1, 3, 1)),  # -1 elsewhere absorbs
        ({"data": 2, "fsdp": -1}, 3, (1, 3, 1)),
        ({"data": 1, "fsdp": -1, "tensor": 2}, 8, (1, 4, 2)),  # fits: unchanged
        ({"data": 4, "fsdp": 2}, 8, (4, 2, 1)),
        (None, 5, (5, 1, 1)),
    ],
)
def test_refit_axis_sizes(saved, num_devices, expected):
    assert refit_axis_sizes(saved, num_devices) == dict(zip(MESH_AXES, expected))


@pytest.mark.parametrize(
    "saved", [{"data": 8}, {"data": 4, "fsdp": 2}, {"fsdp": -1, "tensor": 4}, {"tensor": 6}]
)
def test_a_refit_covers_every_device_and_divides_what_it_keeps(saved):
    for num_devices in range(1, 17):
        sizes = refit_axis_sizes(saved, num_devices)
        assert sizes["data"] * sizes["fsdp"] * sizes["tensor"] == num_devices
        for name in ("fsdp", "tensor"):  # a dimension split over the saved size still splits
            if saved.get(name, 1) != -1:
                assert saved.get(name, 1) % sizes[name] == 0, (saved, num_devices)


@pytest.mark.parametrize(
    "saved, num_devices, message",
    [
        ({"batch": 2}, 2, "Unknown mesh axes"),
        ({"data": -1, "fsdp": -1}, 2, "Only one mesh axis may be -1"),
        ({"data": 0}, 2, "use a positive int or -1"),
        ({"data": 2}, 0, "at least one device"),
    ],
)
def test_refit_axis_sizes_refuses_what_is_not_a_mesh(saved, num_devices, message):
    with pytest.raises(ValueError, match=message):
        refit_axis_sizes(saved, num_devices)


def test_a_multi_slice_mesh_that_no_longer_fits_becomes_one_flat_mesh(devices, caplog):
    # One process here is one "slice": two across slices cannot be laid out.
    with caplog.at_level(logging.INFO, logger="replicator"):
        mesh, dcn_mesh = _eval_mesh({"fsdp": -1}, {"data": 2}, devices)
        assert (mesh, dcn_mesh) == ({"data": 2, "fsdp": 4, "tensor": 1}, None)
        assert _eval_mesh({"data": -1}, None, devices) == ({"data": -1}, None)  # fits: kept
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eval on")]
    assert line == (
        "eval on mesh {'data': 2, 'fsdp': 4, 'tensor': 1} (saved: {'fsdp': -1} per slice "
        "x {'data': 2} across slices; refitted to 8 devices)"
    )


# ---- Through the command line: train on 8 devices, eval on 1 and 3

RUNS = {  # config, overrides, saved mesh, the mesh on 1 and on 3 devices
    "digits_cnn": (
        "configs/digits_cnn.py:smoke",
        ["--config.mesh={'data': 8}"],
        {"data": 8},
        {3: {"data": 3, "fsdp": 1, "tensor": 1}},
    ),
    "lm_tiny": (
        "configs/lm_tiny.py:smoke",
        ["--config.mesh.tensor=2"],  # data=1, fsdp=-1 (4), tensor=2
        {"data": 1, "fsdp": -1, "tensor": 2},
        {3: {"data": 1, "fsdp": 3, "tensor": 1}},
    ),
    "digits_cnn_diloco": (
        "configs/digits_cnn_diloco.py:smoke",
        [],
        {"data": 4, "fsdp": 2},
        {3: {"data": 3, "fsdp": 1, "tensor": 1}},
    ),
}


def eval_line(saved, fitted, num_devices):
    plural = "s" if num_devices > 1 else ""
    return f"eval on mesh {fitted} (saved: {saved}; refitted to {num_devices} device{plural})"


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in ("lm_tiny", "digits_cnn_diloco") else n
        for n in RUNS
    ],
)  # (lm_tiny: 12 s; digits_cnn checks the same on every make test)
def test_eval_on_1_and_3_devices_equals_the_training_runs_eval(name, tmp_path, digits_data_dir):
    config, overrides, saved, fitted = RUNS[name]
    fitted = {1: dict.fromkeys(MESH_AXES, 1), **fitted}
    workdir = str(tmp_path / "run")
    done = run_cli(
        "train", "--config", config, "--workdir", workdir, "--cpu_devices=8",
        f"--config.data_dir={digits_data_dir}", "--config.num_train_steps=2", *overrides,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (trained,) = [r for r in read_records(workdir) if r.get("split") == "test"]
    assert trained["step"] == 2
    for num_devices in (1, 3):
        done = run_cli("eval", "--workdir", workdir, f"--cpu_devices={num_devices}", "--json")
        assert done.returncode == 0, done.stderr[-3000:]
        assert eval_line(saved, fitted[num_devices], num_devices) in lines(done.stderr)
        result = json.loads(done.stdout)
        assert result["step"] == 2 and result["num_examples"] == trained["num_examples"]
        for metric, value in result.items():
            if isinstance(value, float):
                assert value == pytest.approx(trained[metric], rel=1e-5), (num_devices, metric)


def test_training_still_asks_for_exactly_its_mesh(tmp_path):
    done = run_cli(
        "train", "--config", "configs/digits_cnn_diloco.py:smoke",
        "--workdir", str(tmp_path / "run"), "--cpu_devices=1",
    )  # fmt: skip
    assert_one_line_error(
        done,
        "config.mesh={'data': 4, 'fsdp': 2} needs 8 devices but 1 is available",
        "--cpu_devices=8",
        """--config.mesh="{'data': 1, 'fsdp': 1, 'tensor': 1}\"""",
    )
    assert not (tmp_path / "run").exists()
