"""TF-Replicator's GAN in miniature: an SN-GAN on scikit-learn's handwritten digits, on CPU.

Trains a DCGAN-shaped generator (BatchNorm over the global batch, ``tanh``
8x8 output) against a spectrally normalised convolutional discriminator on the
1,437 training scans of the offline ``digits`` dataset, with hinge losses and
two RMSProp optimizers updated in one step (the discriminator at twice the
generator's learning rate), every replica drawing its own latents. Each eval
generates one sample per test scan and scores it with a small digits classifier
(``experiments/gan/score.py``): ``fid``, the Fréchet distance in the
classifier's feature space (lower is better), and ``classifier_score``, its
Inception score (1 to 10). A 10x10 grid of samples goes to
``WORKDIR/samples/step_N.png`` after every eval.

Expected: fid 1.6 and classifier_score 7.5 after 2,000 steps with seed 0 on 8
fake CPU devices (4.3 and 6.6 after 500; the untrained generator scores 204 and
1.2; 360 real training scans score about 1.1-1.7 and 9.6, so the classifier
score shows the remaining gap best), in about 160 s on a shared 2-core CPU
(70 ms per step). Batch-size sweep: ``benchmarks/gan_sweep.py``.

    python -m replicator train --config configs/gan_digits.py --workdir runs/gan_digits

Smoke mode for tests: ``--config configs/gan_digits.py:smoke`` (a few steps of a
smaller GAN).
"""

import ml_collections

from replicator.trainer.config import base_config


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = base_config(mode)
    c.experiment = "experiments.gan"
    c.model = dict(
        noise_dim=32,
        generator_features=(64, 32),  # channels of the 4x4 and 8x8 maps
        discriminator_features=(32, 64, 128),
        d_learning_rate=4e-4,  # the discriminator's; learning_rate is the generator's
        noise="replica",  # latents from rp.replica_key; "example": the same on any device count
    )
    c.dataset = "digits"
    c.batch_size = 64  # global
    c.eval_batch_size = 120  # 360 test scans: 3 batches
    c.num_train_steps = 2000  # about 89 epochs of 1,437 scans
    c.learning_rate = 2e-4
    c.optimizer = "rmsprop"  # no momentum: Adam's default beta1 = 0.9 trains this GAN worse
    c.seed = 0
    c.mesh = dict(data=-1)
    c.log_every_steps = 100
    c.eval_every_steps = 500
    c.checkpoint_every_steps = 500
    c.best_metric = "fid"
    c.best_mode = "min"

    if mode == "smoke":
        c.model.update(generator_features=(16, 8), discriminator_features=(8, 16), noise_dim=8)
        c.batch_size = 32
        c.num_train_steps = 4
        c.log_every_steps = 2
        c.eval_every_steps = 2
        c.checkpoint_every_steps = 2
    return c
