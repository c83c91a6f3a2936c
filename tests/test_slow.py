"""Full-length runs (make test-slow): accuracy targets of the offline default."""

import pytest

from replicator import trainer
from tests.test_train import load_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp32(tmp_path_factory, digits_data_dir):
    config = load_config(mode="", data_dir=digits_data_dir)
    return trainer.train_and_evaluate(config, str(tmp_path_factory.mktemp("fp32")), quiet=True)


def test_digits_reaches_97_percent(fp32):
    assert fp32["accuracy"] >= 0.97 and fp32["num_examples"] == 360


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_within_one_point_of_fp32(tmp_path, digits_data_dir, fp32, precision):
    config = load_config(mode="", data_dir=digits_data_dir, precision=precision)
    result = trainer.train_and_evaluate(config, str(tmp_path), quiet=True)
    assert abs(result["accuracy"] - fp32["accuracy"]) <= 0.01, (result, fp32)
