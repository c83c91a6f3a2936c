"""The trainer on sharded meshes: FSDP and tensor parallelism keep the state sharded.

configs/lm_tiny.py through `train_and_evaluate` on both paths (global view, and
per replica with ZeRO): a data=2, fsdp=2, tensor=2 mesh trains exactly like
data=8, and fsdp=8 holds a fraction of the state on each device.
"""

import importlib.util
import json
import os

import pytest

from replicator import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lm_tiny(data_dir, step_path="compile", **mesh):
    spec = importlib.util.spec_from_file_location("lm_tiny", f"{ROOT}/configs/lm_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()  # the real model: its matrices are big enough to shard
    config.data_dir = data_dir
    config.batch_size, config.eval_batch_size = 16, 64
    config.step_path = step_path
    config.num_train_steps = 3
    config.log_every_steps = 1
    config.eval_every_steps = config.checkpoint_every_steps = 3
    config.mesh = {"data": 1, "fsdp": 1, "tensor": 1, **mesh}
    return config


def train(tmp_path, name, data_dir, step_path="compile", **mesh):
    workdir = str(tmp_path / f"{name}_{step_path}")
    trainer.train_and_evaluate(lm_tiny(data_dir, step_path, **mesh), workdir, quiet=True)
    records = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
    losses = [r["loss"] for r in records if "split" not in r]
    (summary,) = [r for r in records if r.get("split") == "summary"]
    return losses, summary["state_bytes_per_device"]


@pytest.mark.parametrize(
    "step_path",
    # 34 s each: make test-slow (test_lm and test_zero hold the same invariants, faster)
    [pytest.param(path, marks=pytest.mark.slow) for path in ("compile", "run")],
)
def test_sharded_meshes_train_like_data_parallelism(tmp_path, digits_data_dir, step_path):
    losses, data8 = train(tmp_path, "data8", digits_data_dir, step_path, data=8)
    sharded, bytes_2x2x2 = train(
        tmp_path, "2x2x2", digits_data_dir, step_path, data=2, fsdp=2, tensor=2
    )
    assert sharded == pytest.approx(losses, rel=1e-4)
    assert len(losses) == 3
    _, fsdp8 = train(tmp_path, "fsdp8", digits_data_dir, step_path, fsdp=8)
    assert fsdp8 <= 0.3 * data8
    assert bytes_2x2x2 < data8
