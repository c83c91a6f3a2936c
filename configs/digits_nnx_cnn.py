"""The Flax NNX MNIST tutorial's CNN on scikit-learn's handwritten digits, in the trainer.

Trains the tutorial's NNX model (two 3x3 convolutions with cross-replica
BatchNorm, dropout 0.025 and average pooling, then 256 hidden units;
`experiments/classify/nnx_model.py`) on the 1,437 training scans of the offline
``digits`` tfds dataset with Adam, on every local device. Its parameters and
BatchNorm statistics live in ``rp.TrainState`` (``params`` / ``model_state``),
so checkpoints hold both and ``eval`` restores them on any device count.

Expected: 98.9% test accuracy on the 360 test scans (seed 0, one CPU device; the
same 98.9% with ``--config.precision=bf16`` and ``fp16``; on 8 CPU devices,
where every replica draws its own dropout masks, 98.9% fp32 and 98.3% bf16), in
about 11 s (fp32) to 17-19 s (bf16, fp16) on a 2-core CPU, 25-29 s on 8 fake CPU
devices. ``eval`` restores the checkpoint on 1 or 3 devices with the same
accuracy (loss to 1e-7).

    python -m replicator train --config configs/digits_nnx_cnn.py --workdir runs/digits_nnx_cnn
    python -m replicator eval --config configs/digits_nnx_cnn.py --workdir runs/digits_nnx_cnn

Smoke mode for tests: ``--config configs/digits_nnx_cnn.py:smoke`` (a few steps).
"""

import ml_collections

from replicator.trainer.config import base_config


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = base_config(mode)  # every key with its default, so every key can be overridden
    c.experiment = "experiments.classify"
    c.model = dict(
        arch="nnx_cnn", num_classes=10, conv_features=(32, 64), hidden_features=256,
        dropout_rate=0.025,
    )  # fmt: skip
    c.dataset = "digits"

    c.batch_size = 64  # global
    c.eval_batch_size = 128
    c.num_train_steps = 1200  # about 53 epochs of 1,437 examples
    c.learning_rate = 2e-3
    c.seed = 0

    c.log_every_steps = 50
    c.eval_every_steps = 400
    c.checkpoint_every_steps = 400

    if mode == "smoke":
        c.num_train_steps = 4
        c.log_every_steps = 2
        c.eval_every_steps = 2
        c.checkpoint_every_steps = 2
    return c
