"""Full-length runs (make test-slow): accuracy targets of the offline default."""

import pytest

from replicator import trainer
from tests.helpers.configs import digits_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp32(tmp_path_factory, digits_data_dir):
    config = digits_config(mode="", data_dir=digits_data_dir)
    return trainer.train_and_evaluate(config, str(tmp_path_factory.mktemp("fp32")), quiet=True)


def test_digits_reaches_97_percent(fp32):
    assert fp32["accuracy"] >= 0.97 and fp32["num_examples"] == 360


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_within_one_point_of_fp32(tmp_path, digits_data_dir, fp32, precision):
    config = digits_config(mode="", data_dir=digits_data_dir, precision=precision)
    result = trainer.train_and_evaluate(config, str(tmp_path), quiet=True)
    assert abs(result["accuracy"] - fp32["accuracy"]) <= 0.01, (result, fp32)


def test_diloco_islands_reach_97_percent_with_20x_less_traffic(tmp_path, digits_data_dir):
    """configs/digits_cnn_diloco.py in full: 4 islands meeting every 20 steps."""
    import json
    import os

    from tests.test_diloco import diloco_config

    config = diloco_config(data_dir=digits_data_dir)
    config.update(
        dict(num_train_steps=1200, log_every_steps=50, eval_every_steps=400,
             checkpoint_every_steps=400)
    )  # fmt: skip
    config.diloco.inner_steps = 20
    result = trainer.train_and_evaluate(config, str(tmp_path), quiet=True)
    assert result["accuracy"] >= 0.97 and result["num_examples"] == 360
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        summary = [r for r in map(json.loads, f) if "cross_island_bytes_per_step" in r][-1]
    assert summary["cross_island_bytes_per_step"] * 20 <= summary["data_parallel_bytes_per_step"]


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_nnx_cnn_reaches_97_percent_and_evaluates_on_1_and_3_devices(
    tmp_path, digits_data_dir, precision
):
    """configs/digits_nnx_cnn.py in full (the Flax NNX tutorial's CNN), on 8 replicas."""
    import jax

    from tests.helpers.configs import CONFIG_DIR
    from tests.helpers.configs import load_config as load_config_file

    config = load_config_file(CONFIG_DIR / "digits_nnx_cnn.py", "")
    config.update(data_dir=digits_data_dir, precision=precision)
    result = trainer.train_and_evaluate(config, str(tmp_path), quiet=True)
    assert result["accuracy"] >= 0.97 and result["num_examples"] == 360
    for count in (1, 3):
        got = trainer.evaluate(config, str(tmp_path), devices=jax.devices()[:count])
        assert got["accuracy"] == pytest.approx(result["accuracy"], abs=1e-9)
