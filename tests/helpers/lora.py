"""What the LoRA tests share: the LM's parameters with random adapters, those adapters
merged into a plain model's kernels, Hugging Face tensors made as an export makes them,
and a LoRA train step run on a mesh (the base frozen as the trainer freezes it)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import replicator as rp
from experiments.lm import lora
from replicator.trainer.optimizer import OptimizerSpec, mark_frozen
from tests.helpers.steps import train_steps


def flat(params: Any) -> dict[str, Any]:
    """``params`` by path (``blocks/attention/q_kernel``), boxes unwrapped."""
    leaves = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(params))[0]
    return {"/".join(str(getattr(k, "key", k)) for k in keys): x for keys, x in leaves}


def nested(by_path: dict[str, Any]) -> dict[str, Any]:
    """`flat`'s inverse."""
    out: dict[str, Any] = {}
    for path, x in by_path.items():
        *parents, name = path.split("/")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[name] = x
    return out


def random_params(model: Any, tokens: Any, seed: int = 0) -> dict[str, Any]:
    """Parameters of ``model`` drawn with numpy from its shapes (compiling XLA's random
    init takes seconds on CPU): kernels and embeddings normal, QLoRA's quantized from such
    a draw (`lora.quantize`), adapters as a fresh one is (A uniform, B zero)."""
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))["params"]
    by_path, rng = flat(abstract), np.random.default_rng(seed)
    out = {}
    for path, leaf in by_path.items():
        if path.endswith(lora.SCALE):
            continue
        if path.endswith(lora.ADAPTERS[1]):
            out[path] = np.zeros(leaf.shape, leaf.dtype)
        elif path.endswith(lora.ADAPTERS[0]):
            out[path] = rng.uniform(-0.2, 0.2, leaf.shape).astype(leaf.dtype)
        elif path + lora.SCALE in by_path:
            kind = model.lora_quantize
            shape = (*leaf.shape[:-1], leaf.shape[-1] * (2 if kind == "nf4" else 1))
            w = rng.normal(0.0, 0.1, shape).astype(np.float32)
            out[path], out[path + lora.SCALE] = lora.quantize(w, kind, np)
        else:
            out[path] = rng.normal(0.0, 0.1, leaf.shape).astype(leaf.dtype)
    return nested({p: jnp.asarray(x) for p, x in out.items()})


def with_random_adapters(params: Any, seed: int = 0, scale: float = 0.3) -> dict[str, Any]:
    """``params`` (unboxed) with every adapter's ``A`` and ``B`` drawn at random: a
    nonzero product, unlike a fresh adapter's."""
    rng = np.random.default_rng(seed)
    by_path = flat(params)
    for path, x in by_path.items():
        if path.endswith(lora.ADAPTERS):
            by_path[path] = jnp.asarray(rng.normal(0.0, scale, x.shape), x.dtype)
    return nested(by_path)


def merged_params(params: Any, model: Any) -> dict[str, Any]:
    """The plain model's parameters: each adapted kernel ``W + (alpha / rank) A B`` (QLoRA's
    dequantized first), adapters and scales dropped. Stacked kernels merge layer by layer."""
    by_path = {p: np.asarray(x) for p, x in flat(params).items()}
    out = {}
    for path, x in by_path.items():
        if path.endswith(lora.ADAPTERS) or path.endswith(lora.SCALE):
            continue
        if path + lora.SCALE in by_path:
            x = lora.dequantize(x, by_path[path + lora.SCALE], model.lora_quantize, np)
        if path + lora.ADAPTERS[0] in by_path:
            a, b = by_path[path + lora.ADAPTERS[0]], by_path[path + lora.ADAPTERS[1]]
            scale = model.lora_alpha / model.lora_rank
            if path.startswith("blocks/"):
                x = np.stack([lora.merge(w, ai, bi, scale) for w, ai, bi in zip(x, a, b)])
            else:
                x = lora.merge(x, a, b, scale)
        out[path] = jnp.asarray(x)
    return nested(out)


def hf_tensors(tensors: Any, params: Any) -> dict[str, np.ndarray]:
    """Hugging Face's tensors of ``params`` by the maps ``tensors`` (`HFTensor`s, their
    ``also`` too), each layer of a stack apart, as ``export`` makes them."""
    by_path = {p: np.asarray(x) for p, x in flat(params).items()}
    out = {}
    for t in tensors:
        for layer in range(t.layers) if t.layers else [None]:
            args = [by_path[p] if layer is None else by_path[p][layer] for p in (t.path, *t.also)]
            made = [np.ascontiguousarray(x) for x in t.to_hf(*args)]
            out.update(zip(t.names_of(layer), made, strict=True))
    return out


def train_lora(
    repl: Any, path: str, batches: list, model: dict, params: Any, **options: Any
) -> tuple:
    """``model`` (LM keys, with LoRA) from ``params`` trained by Adam on ``batches`` through
    the LM experiment's train step (``options``: its keys, e.g. ``remat_policy``), every
    parameter but the adapters frozen (as the trainer freezes them); the per-step losses
    and the parameters after."""
    from experiments.lm import make_experiment
    from experiments.lm.task import summarize
    from replicator.trainer.experiment import Settings

    frozen = lora.FROZEN_BY_LORA
    spec = OptimizerSpec(learning_rate=1e-2, num_train_steps=len(batches), freeze=frozen)
    settings = Settings(
        repl=repl, model=model, learning_rate=1e-2, optimizer="adam",
        num_train_steps=len(batches), grad_accum_steps=1, seed=0, optimizer_spec=spec,
        options=options,
    )  # fmt: skip
    experiment = make_experiment(settings)
    tx = settings.make_optimizer()  # the experiment's, made again: the same state's shape

    def init():
        return mark_frozen(rp.TrainState.create(params, tx, jax.random.key(0)), frozen)

    state = repl.init(init)
    return train_steps(repl, path, experiment.train_step, state, batches, summarize)
