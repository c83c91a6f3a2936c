"""The GAN task: two players, two optimizers, one train step; eval scores the samples.

The train step is written once, for one replica, as TF-Replicator's GAN is: a
discriminator update on real images and generated ones, then a generator update
against the new discriminator, both in one compiled step. Each loss goes through
`rp.compute_average_loss` and each optimizer is wrapped by the Replicator, so
the step runs unchanged under `Replicator.run` (per replica) and
`Replicator.compile` (global view). The generator's BatchNorm averages over
``repl.axis_name``: its statistics are those of the global batch on both paths.

Noise: by default each replica draws its own latents from
``rp.replica_key(fold_in(rng, step))``, the seed's recipe. With
``noise="example"`` each example's latent is drawn from a key of its own (the
step's key folded with the example's ``noise_seed``, a checksum of its pixels),
so the samples do not depend on how the batch is split: 8 replicas then train
exactly like 1 device. Eval always draws per example, so its samples are a fixed
set for any device count, batch size and padding.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import optax
from flax import struct

import replicator as rp
from experiments.gan.model import SPECTRAL, Discriminator, Generator
from experiments.gan.score import fit_digits_classifier, score_sums, summarize_scores, to_unit_range
from replicator import storage
from replicator.trainer import ConfigError, ConfigKeys, Experiment, Settings

METRIC_NAMES = ("fid", "classifier_score")
NOISE_MODES = ("replica", "example")
GRID_SIDE = 10  # the PNG after each eval shows GRID_SIDE x GRID_SIDE samples
_GRID_KEY, _EVAL_KEY = 1, 2  # streams folded into the seed: fixed latents for eval


@dataclasses.dataclass(frozen=True)
class GANConfig:
    """The experiment's keyword arguments (``config.model``).

    Attributes:
      noise_dim: size of the latent vector.
      generator_features: channels of the generator's 4x4 and 8x8 maps.
      discriminator_features: channels of the discriminator's convolutions.
      d_learning_rate: the discriminator's learning rate; None: the config's
        ``learning_rate``, which is the generator's.
      noise: ``"replica"`` (latents from `rp.replica_key`) or ``"example"``
        (from each example's ``noise_seed``: independent of the device count).
    """

    noise_dim: int = 32
    generator_features: Sequence[int] = (64, 32)
    discriminator_features: Sequence[int] = (32, 64, 128)
    d_learning_rate: float | None = None
    noise: str = "replica"

    def __post_init__(self):
        if self.noise not in NOISE_MODES:
            raise ConfigError(f"config.model.noise={self.noise!r} is not one of {NOISE_MODES}.")

    @classmethod
    def from_model(cls, model: Mapping[str, Any]) -> GANConfig:
        """Reads ``config.model``, naming any key that is not a field."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(model) - known)
        if unknown:
            raise ConfigError(
                f"config.model has keys that experiments.gan does not take: {unknown}; "
                f"it takes {sorted(known)}."
            )
        return cls(**model)


def check_config(values: Mapping[str, Any]) -> list[str]:
    """`GANConfig`'s own checks of ``config.model``, made before anything is written."""
    try:
        GANConfig(**values["model"])
    except ConfigError as e:
        return [str(e)]
    return []


# The GAN's config keys: its model's (`GANConfig`'s fields: types, meanings; the defaults
# are the fields'); no top-level key of its own, no mesh axis beyond data, fsdp and tensor.
_MODEL_ROWS = {
    "noise_dim": ((int,), "size of the latent vector"),
    "generator_features": ((tuple, list), "channels of the generator's 4x4 and 8x8 maps"),
    "discriminator_features": ((tuple, list), "channels of the discriminator's convolutions"),
    "d_learning_rate": ((float, None), "the discriminator's learning rate (None: learning_rate)"),
    "noise": ((str,), "'replica' (rp.replica_key) or 'example' (each example's own latents)"),
}
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(GANConfig)}
CONFIG_KEYS = ConfigKeys(
    model={
        name: (types, _DEFAULTS[name], meaning) for name, (types, meaning) in _MODEL_ROWS.items()
    },
    check=check_config,
)


@struct.dataclass
class GANState:
    """The two players' train states, updated together by one train step."""

    generator: rp.TrainState
    discriminator: rp.TrainState


def preprocess(batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """uint8 images -> float32 in [-1, 1], plus each example's ``noise_seed``.

    The seed is the CRC-32 of the example's pixels: a fixed key per example
    that needs no index (the loader gives none) and survives any batching.
    """
    images = np.asarray(batch["image"])
    seeds = [zlib.crc32(np.ascontiguousarray(image).tobytes()) for image in images]
    return {"image": to_unit_range(images), "noise_seed": np.asarray(seeds, np.uint32)}


def draw_noise(key: jax.Array, noise_seed_B: jax.Array, noise_dim: int, mode: str) -> jax.Array:
    """Latents ``[B, noise_dim]``: per replica from `rp.replica_key`, or per example."""
    if mode == "example":
        draw = lambda seed: jax.random.normal(jax.random.fold_in(key, seed), (noise_dim,))
        return jax.vmap(draw)(noise_seed_B)
    return jax.random.normal(rp.replica_key(key), (noise_seed_B.shape[0], noise_dim))


def make_train_step(
    generator: Any,
    discriminator: Any,
    g_tx: optax.GradientTransformation,
    d_tx: optax.GradientTransformation,
    config: GANConfig,
    repl: rp.Replicator,
):
    """Returns ``train_step(state, batch) -> (state, sums)`` with hinge losses.

    ``sums``: ``d_loss`` and ``g_loss`` summed over this replica's examples,
    and their ``count``.
    """

    def train_step(state: GANState, batch: Mapping[str, jax.Array]):
        g_state, d_state = state.generator, state.discriminator
        step_key = jax.random.fold_in(g_state.rng, g_state.step)
        d_key, g_key = jax.random.split(step_key)
        noise = functools.partial(
            draw_noise, noise_seed_B=batch["noise_seed"], noise_dim=config.noise_dim,
            mode=config.noise,
        )  # fmt: skip
        g_variables = {"params": g_state.params, **g_state.model_state}
        fake, _ = generator.apply(g_variables, noise(d_key), mutable=["batch_stats"])
        fake = jax.lax.stop_gradient(fake)

        def d_loss_fn(params, model_state, pair):
            images = jnp.concatenate([pair["real"], pair["fake"]])
            logits, new_model_state = discriminator.apply(
                {"params": params, **model_state}, images, update_stats=True, mutable=[SPECTRAL]
            )
            real_logits, fake_logits = jnp.split(logits, 2)
            per_example = jax.nn.relu(1 - real_logits) + jax.nn.relu(1 + fake_logits)
            sums = {"d_loss": jnp.sum(per_example), "count": jnp.sum(jnp.ones_like(per_example))}
            return rp.compute_average_loss(per_example), (new_model_state, sums)

        (_, (d_model_state, d_sums)), d_grads = d_state.value_and_grad(
            d_loss_fn, {"real": batch["image"], "fake": fake}, has_aux=True
        )
        if d_state.grad_accum_steps > 1:
            # Microbatches differentiate per-replica copies of the parameters, so the
            # power iteration's (equal) results come back per replica: keep them mirrored.
            d_model_state = repl.reduce(rp.ReduceOp.MEAN, d_model_state)
        d_state = d_state.apply_gradients(d_grads, d_tx, model_state=d_model_state)

        def g_loss_fn(params, model_state, latents):
            fake, new_model_state = generator.apply(
                {"params": params, **model_state}, latents, mutable=["batch_stats"]
            )
            d_variables = {"params": d_state.params, **d_state.model_state}
            per_example = -discriminator.apply(d_variables, fake)
            return rp.compute_average_loss(per_example), (new_model_state, jnp.sum(per_example))

        (_, (g_model_state, g_loss_sum)), g_grads = g_state.value_and_grad(
            g_loss_fn, noise(g_key), has_aux=True
        )
        g_state = g_state.apply_gradients(g_grads, g_tx, model_state=g_model_state)
        sums = {**d_sums, "g_loss": g_loss_sum}
        return GANState(generator=g_state, discriminator=d_state), sums

    return train_step


def make_eval_step(generator: Any, config: GANConfig, seed: int):
    """Returns ``eval_step(eval_state, batch) -> sums``: one sample per real eval example.

    The sample's latent comes from the example's ``noise_seed``; the sums are
    `score_sums` of the samples against the real images, masked.
    """

    def eval_step(eval_state: Mapping[str, Any], batch: Mapping[str, jax.Array]):
        g_state = eval_state["generator"]
        key = jax.random.fold_in(jax.random.key(seed), _EVAL_KEY)
        latents = draw_noise(key, batch["noise_seed"], config.noise_dim, "example")
        variables = {"params": g_state.params, **g_state.model_state}
        samples = generator.apply(variables, latents, train=False)
        return score_sums(fit_digits_classifier(), samples, batch["image"], batch["mask"])

    return eval_step


def summarize(sums: Mapping[str, Any]) -> dict[str, float]:
    """Train sums -> ``g_loss``, ``d_loss`` (means per example) and ``loss`` (their sum,
    the game's total objective, which every train record carries); eval sums -> scores."""
    if "g_loss" in sums:
        count = float(sums["count"])
        g_loss, d_loss = float(sums["g_loss"]) / count, float(sums["d_loss"]) / count
        return {"loss": g_loss + d_loss, "g_loss": g_loss, "d_loss": d_loss}
    return summarize_scores(sums)


def make_sample_writer(generator: Any, config: GANConfig, seed: int):
    """Returns ``after_eval(eval_state, workdir, step)``: writes ``samples/step_<step>.png``.

    The grid shows the same ``GRID_SIDE**2`` latents at every eval, so the files
    read as a film of the generator's progress.
    """
    key = jax.random.fold_in(jax.random.key(seed), _GRID_KEY)
    latents = jax.random.normal(key, (GRID_SIDE * GRID_SIDE, config.noise_dim))
    sample = jax.jit(functools.partial(generator.apply, train=False))

    def write_sample_grid(eval_state: Mapping[str, Any], workdir: str, step: int) -> str:
        g_state = eval_state["generator"]
        variables = _local_copy({"params": g_state.params, **g_state.model_state})
        samples = np.asarray(sample(variables, latents))
        path = storage.join(workdir, "samples", f"step_{step}.png")
        png = io.BytesIO()
        matplotlib.image.imsave(
            png, tile_images(samples), cmap="gray", vmin=0, vmax=1, format="png"
        )
        storage.write_bytes(path, png.getvalue())  # local or gs://
        return path

    return write_sample_grid


def tile_images(images_NxHxWx1: np.ndarray, scale: int = 4) -> np.ndarray:
    """``[N, H, W, 1]`` in [-1, 1] -> one square grid in [0, 1], each image enlarged ``scale``x.

    >>> tile_images(np.zeros((4, 8, 8, 1)), scale=2).shape  # 2 x 2 tiles of 16 + 1px gaps
    (35, 35)
    """
    side = int(np.ceil(np.sqrt(len(images_NxHxWx1))))
    tiles = (np.asarray(images_NxHxWx1[..., 0], np.float32) + 1) / 2
    tiles = tiles.repeat(scale, axis=1).repeat(scale, axis=2)
    height, width = tiles.shape[1:]
    grid = np.ones((side * (height + 1) + 1, side * (width + 1) + 1), np.float32)
    for i, tile in enumerate(tiles):
        row, col = divmod(i, side)
        top, left = 1 + row * (height + 1), 1 + col * (width + 1)
        grid[top : top + height, left : left + width] = tile
    return grid


def init_state(
    generator: Any,
    discriminator: Any,
    g_tx: optax.GradientTransformation,
    d_tx: optax.GradientTransformation,
    config: GANConfig,
    settings: Settings,
    rng: jax.Array,
    example: Mapping[str, Any],
) -> GANState:
    """Both players' initial states, shaped by one preprocessed example."""
    g_rng, d_rng, noise_rng = jax.random.split(rng, 3)
    g_vars = generator.init(g_rng, jnp.zeros((1, config.noise_dim)), train=False)
    d_vars = discriminator.init(d_rng, jnp.asarray(example["image"])[None])
    create = functools.partial(
        rp.TrainState.create,
        rng=noise_rng,
        policy=settings.repl.precision,
        grad_accum_steps=settings.grad_accum_steps,
    )
    return GANState(
        generator=create(
            g_vars["params"], g_tx, model_state={"batch_stats": g_vars["batch_stats"]}
        ),
        discriminator=create(d_vars["params"], d_tx, model_state={SPECTRAL: d_vars[SPECTRAL]}),
    )


def make_experiment(settings: Settings) -> Experiment:
    """TF-Replicator's GAN on the trainer's Replicator.

    Args:
      settings: from the trainer; ``settings.model`` holds `GANConfig`'s fields.
        The generator trains at ``settings.learning_rate``, the discriminator at
        ``model.d_learning_rate`` (default: the same), each with the configured
        optax optimizer, wrapped for the replicas.

    Returns:
      The experiment: its state a `GANState`; train records ``g_loss`` and
      ``d_loss``; eval records ``fid`` and ``classifier_score`` (eval restores
      only the generator); a grid of samples in ``WORKDIR/samples/`` after each eval.

    Raises:
      ValueError: ``config.model`` has a key that `GANConfig` does not.
    """
    config = GANConfig.from_model(settings.model)
    repl = settings.repl
    generator = Generator(features=tuple(config.generator_features), axis_name=repl.axis_name)
    discriminator = Discriminator(features=tuple(config.discriminator_features))
    g_model, d_model = repl.apply_policy(generator), repl.apply_policy(discriminator)
    g_tx = settings.make_optimizer()
    d_tx = settings.make_optimizer(config.d_learning_rate)
    return Experiment(
        preprocess=preprocess,
        init_state=functools.partial(init_state, g_model, d_model, g_tx, d_tx, config, settings),
        train_step=make_train_step(g_model, d_model, g_tx, d_tx, config, repl),
        eval_step=make_eval_step(g_model, config, settings.seed),
        summarize=summarize,
        metric_names=METRIC_NAMES,
        eval_state=lambda state: {"generator": state.generator},
        after_eval=make_sample_writer(g_model, config, settings.seed),
    )


def _local_copy(tree: Any) -> Any:
    # Mirrored arrays hold the whole value on every device: read this process's copy,
    # so that process 0 can sample alone without a program spanning every process.
    def copy(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_data(0))
        return np.asarray(x)

    return jax.tree.map(copy, tree)
