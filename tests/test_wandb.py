"""Weights & Biases as a writer beside TensorBoard, in W&B's offline mode.

Nothing leaves the machine: every run is offline, its files under the test's
tmp_path, and W&B's server address is a closed local port. What the runs hold is
read back from their transaction logs (``run-ID.wandb``) by wandb's own reader,
``wandb leet inspect --json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import wandb

from replicator import storage
from replicator.errors import ConfigError
from replicator.trainer.writers import MetricWriter, check_writers

BOTH = ("tensorboard", "wandb")


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # a closed local port
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))
    wandb.teardown()  # wandb reads its variables once per process, at its setup
    yield
    wandb.teardown()


def wandb_runs(root) -> list[list[dict]]:
    """The records of each offline W&B run under ``root/wandb``, oldest first."""
    logs = sorted(root.glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime)
    return [read_log(path) for path in logs]


def read_log(path) -> list[dict]:
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=120)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def of_type(records, kind: str) -> list[dict]:
    return [r[kind] for r in records if r["type"] == kind]


def history(records) -> dict[int, dict]:
    """Each step's row, without W&B's own keys (``_step``, ``_runtime``, ...)."""
    rows = {}
    for row in of_type(records, "history"):
        step = row["step"]["num"]
        assert step not in rows, f"step {step} twice"
        rows[step] = {k: v for k, v in row["item"].items() if not k.startswith("_")}
    return rows


def summary(records) -> dict:
    values = {}
    for update in of_type(records, "summary"):
        values.update(update.get("update", {}))
    return {k: v for k, v in values.items() if not k.startswith("_")}


def jsonl_rows(workdir) -> dict[int, dict]:
    """metrics.jsonl as W&B should show it: ``split/metric`` per step."""
    rows = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        split = record.get("split") or "train"
        values = {f"{split}/{k}": v for k, v in record.items() if k not in ("step", "split")}
        rows.setdefault(record["step"], {}).update(values)
    return rows


def test_records_config_and_summary_go_to_one_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    workdir = tmp_path / "run"
    config = {"learning_rate": 0.1, "model": {"features": [8, 16]}, "writers": list(BOTH)}
    writer = MetricWriter(str(workdir), writers=BOTH, config=config)
    writer.write(1, {"loss": 2.0, "learning_rate": 0.1})
    writer.write(2, {"loss": 1.5, "learning_rate": 0.1})
    writer.write(2, {"accuracy": 0.75, "num_examples": 4}, split="test")
    writer.write(2, {"wall_time_s": 3.5, "mfu": 0.25, "peak": "f32 matmul"}, split="summary")
    writer.close()

    [records] = wandb_runs(tmp_path / "wandb_dir")
    [run] = of_type(records, "run")
    assert run["run_id"] == (workdir / "wandb_run_id").read_text().strip()
    assert run["project"] == "replicator"
    assert {k: v for k, v in run["config"]["update"].items() if k != "_wandb"} == config
    assert history(records) == {
        1: {"train/loss": 2.0, "train/learning_rate": 0.1},
        2: {"train/loss": 1.5, "train/learning_rate": 0.1, "test/accuracy": 0.75,
            "test/num_examples": 4},
    }  # fmt: skip
    assert summary(records) == {
        **history(records)[2],  # W&B's own: each key's last value
        "summary/wall_time_s": 3.5,
        "summary/mfu": 0.25,
        "summary/peak": "f32 matmul",
    }
    # (The record also has "runtime", whole seconds, where the run took one or more.)
    assert [r["exit_code"] for r in of_type(records, "exit")] == [0]
    # The other writers as before.
    assert len(jsonl_rows(workdir)) == 2
    assert [p.name[:19] for p in (workdir / "tensorboard").iterdir()] == ["events.out.tfevents"]


def test_a_resumed_run_continues_the_same_wandb_run_each_step_once(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "from-the-environment")
    workdir = tmp_path / "run"

    def attempt(resume_step, steps):
        writer = MetricWriter(str(workdir), resume_step=resume_step, writers=BOTH,
                              config={"seed": 0})  # fmt: skip
        for step in steps:
            writer.write(step, {"loss": 1.0 / step})
            if step % 2 == 0:
                writer.write(step, {"accuracy": step / 10}, split="test")
        writer.close()  # as on preemption

    attempt(0, range(1, 8))  # stopped after step 7; its last checkpoint was step 4
    attempt(4, range(5, 11))  # redoes 5..7 with the same values, then goes on

    run_id = (workdir / "wandb_run_id").read_text().strip()
    first, second = wandb_runs(workdir)  # W&B's files in the workdir (no WANDB_DIR)
    for records in (first, second):
        [run] = of_type(records, "run")
        assert (run["run_id"], run["project"]) == (run_id, "from-the-environment")
    assert sorted(history(first)) == list(range(1, 8))
    assert sorted(history(second)) == [8, 9, 10]  # not 5..7 again: W&B has them
    assert {**history(first), **history(second)} == jsonl_rows(workdir)


def test_wandb_turned_on_part_way_gets_the_records_so_far(tmp_path):
    workdir = tmp_path / "run"
    writer = MetricWriter(str(workdir))  # TensorBoard only
    for step in range(1, 7):
        writer.write(step, {"loss": 1.0 / step})
    writer.close()
    writer = MetricWriter(str(workdir), resume_step=4, writers=BOTH)
    for step in range(5, 9):
        writer.write(step, {"loss": 1.0 / step})
    writer.close()

    [records] = wandb_runs(workdir)
    assert history(records) == jsonl_rows(workdir)
    assert sorted(history(records)) == list(range(1, 9))


def test_a_bucket_workdir_keeps_the_run_id_in_the_bucket(tmp_path, bucket, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # W&B's local files
    workdir = f"{bucket}/run"
    for resume_step in (0, 1):
        writer = MetricWriter(workdir, resume_step=resume_step, writers=("wandb",))
        writer.write(resume_step + 1, {"loss": 1.0})
        writer.close()
    run_id = storage.read_text(f"{workdir}/wandb_run_id").strip()
    local = sorted(tmp_path.glob(f"replicator-wandb-*/wandb/offline-run-*-{run_id}*"))
    assert len(local) == 2
    assert not storage.exists(f"{workdir}/tensorboard")  # not asked for


def test_without_wandb_asking_for_it_is_one_line_before_the_workdir(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError) as error:
        MetricWriter(str(workdir), writers=BOTH)
    message = str(error.value)
    assert "\n" not in message and "pip install 'replicator[wandb]'" in message
    assert not workdir.exists()
    assert check_writers(["tensorboard"]) == ("tensorboard",)  # needs no wandb


def test_unknown_writers_are_config_errors():
    with pytest.raises(ConfigError, match=r"\['mlflow'\]; the writers are 'tensorboard', 'wandb'"):
        check_writers(["tensorboard", "mlflow"])
    with pytest.raises(ConfigError, match="not 'wandb'"):
        check_writers("wandb")


def test_online_without_a_login_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")  # the server address stays a closed local port
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no credentials anywhere
    with pytest.raises(ConfigError) as error:
        MetricWriter(str(tmp_path / "run"), writers=BOTH)
    message = str(error.value)
    assert "\n" not in message and "wandb login" in message and "WANDB_MODE=offline" in message
