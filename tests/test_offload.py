"""Optimizer state in host memory between steps (``offload_optimizer_state``).

The moments live in pinned host memory and are fetched for the update: the run
trains exactly as with them on the devices, resumes from a checkpoint into host
memory, and says one line when asked for it on the per-replica path.
"""

import json

import jax
import numpy as np
import pytest

from replicator import trainer
from replicator.trainer import ConfigError
from tests.test_train_sharded import lm_tiny


def _train(tmp_path, name, data_dir, steps: int, offload: bool) -> list[float]:
    config = lm_tiny(data_dir, "compile", fsdp=8)
    config.num_train_steps = steps
    config.checkpoint_every_steps = 2
    config.eval_every_steps = 100
    config.offload_optimizer_state = offload
    workdir = str(tmp_path / name)
    trainer.train_and_evaluate(config, workdir, quiet=True)
    records = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
    return [r["loss"] for r in records if "split" not in r]


@pytest.mark.slow  # three short trainer runs, about 40 s
def test_offloaded_optimizer_state_trains_and_resumes_exactly(tmp_path, digits_data_dir):
    on_device = _train(tmp_path, "device", digits_data_dir, 4, offload=False)
    first = _train(tmp_path, "host", digits_data_dir, 2, offload=True)
    resumed = _train(tmp_path, "host", digits_data_dir, 4, offload=True)  # from step 2
    assert first == on_device[:2]
    assert resumed[-2:] == on_device[2:]


def test_the_compiled_step_keeps_the_moments_in_host_memory(digits_data_dir):
    from replicator.trainer.setup import setup

    config = lm_tiny(digits_data_dir, "compile", fsdp=8)
    config.offload_optimizer_state = True
    run = setup(config)
    kinds = {s.memory_kind for s in jax.tree.leaves(run.state_shardings.opt_state)}
    assert kinds == {"pinned_host"}
    assert {s.memory_kind for s in jax.tree.leaves(run.state_shardings.params)} == {"device"}
    state = run.init_state()
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {"pinned_host"}
    assert np.all(np.isfinite(jax.tree.leaves(state.params)[0]))


def test_offload_on_the_per_replica_path_is_one_line(digits_data_dir):
    config = lm_tiny(digits_data_dir, "run", fsdp=8)
    config.offload_optimizer_state = True
    with pytest.raises(ConfigError, match="needs step_path='compile'"):
        trainer.config.validate(config)
