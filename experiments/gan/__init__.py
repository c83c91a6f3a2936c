"""TF-Replicator's GAN in miniature: SN-GAN on 8x8 digits, two optimizers in one step.

``make_experiment(settings)`` is the trainer's entry point (`configs/gan_digits.py`);
``CONFIG_KEYS`` declares its ``model`` keys (`GANConfig`'s fields).
"""

from experiments.gan.model import Discriminator as Discriminator
from experiments.gan.model import Generator as Generator
from experiments.gan.score import fit_digits_classifier as fit_digits_classifier
from experiments.gan.score import frechet_distance as frechet_distance
from experiments.gan.score import score_sums as score_sums
from experiments.gan.score import summarize_scores as summarize_scores
from experiments.gan.task import CONFIG_KEYS as CONFIG_KEYS
from experiments.gan.task import GANConfig as GANConfig
from experiments.gan.task import GANState as GANState
from experiments.gan.task import make_experiment as make_experiment
from experiments.gan.task import preprocess as preprocess
