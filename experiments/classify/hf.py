"""The ViT's Hugging Face checkpoints: ``config.json`` <-> model keys, HF names <-> parameters.

`hf_checkpoint` is the classify experiment's hook for ``init_from='hf:DIR'`` and
``export --format hf`` (`replicator.trainer.pretrained`), for ``ViTModel`` and
``ViTForImageClassification`` checkpoints (``model_type`` ``"vit"``), checked against
transformers' own modeling code (tests/test_vit.py). The fine-tuning recipe is
big_vision's:

* The backbone's shape comes from ``config.json`` (`SHAPE_KEYS`); the run keeps its
  own ``image_size`` (default: the checkpoint's) and ``num_classes``.
* Where the run's patch grid (``image_size // patch_size``) differs from the
  checkpoint's, the position embeddings are resampled once, at load time, to the
  run's grid: bicubically, exactly as Hugging Face's ``interpolate_pos_encoding=True``
  does at every forward (`experiments.classify.vit.resize_position_embedding`).
* The head: a ``ViTForImageClassification`` whose ``classifier`` has the run's
  ``num_classes`` loads it (resuming that classifier); any other checkpoint (a
  ``ViTModel``, or another number of labels) leaves the head fresh, zero as
  big_vision starts it. ``config.init_from_skip='params/head/'`` keeps it fresh
  whatever the checkpoint has (big_vision's ``dont_load``).
* ``ViTModel``'s ``pooler`` (dense + tanh) is not used: the head reads the final
  LayerNorm's [CLS] token, as ``ViTForImageClassification`` does.

Hugging Face's ``nn.Linear`` weights are ``[out, in]`` (transposed here), its
patch convolution ``[E, C, p, p]`` (ours ``[p, p, C, E]``, NHWC), and q, k and v
are three projections (ours one ``qkv_kernel [E, 3, H, D]``). Exported, a run is
a ``ViTForImageClassification`` of its ``image_size`` and ``num_classes``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from experiments.classify.vit import ViT, resize_position_embedding
from replicator.trainer import ConfigError
from replicator.trainer.pretrained import HFLayout, HFTensor

SHAPE_KEYS = (
    "arch", "patch_size", "embed_dim", "num_layers", "num_heads", "mlp_dim", "norm_eps",
    "qkv_bias", "num_channels",
)  # fmt: skip
CLASSIFIER = "ViTForImageClassification"


def hf_checkpoint(
    model: Mapping[str, Any],
    hf_config: Mapping[str, Any] | None = None,
    *,
    tokenizer: str | None = None,
) -> HFLayout:
    """The ViT's `HFLayout`: importing (``hf_config`` given) or exporting ``model``.

    Args:
      model: the config's ``model`` keys.
      hf_config: a checkpoint's ``config.json``; None to describe ``model`` for export.
      tokenizer: unused (images have none); the hook's signature is the trainer's.

    Returns:
      The layout: the model keys (the checkpoint's `SHAPE_KEYS` on top of
      ``model``'s), the ``config.json``, a one-line summary and every parameter's
      tensors.

    Raises:
      ConfigError: a checkpoint other than a ViT with the exact GELU; exporting a
        model that is no ViT.

    >>> hf = hf_checkpoint({"arch": "cnn", "num_classes": 10, "image_size": 8},
    ...     {"model_type": "vit", "hidden_size": 32, "num_hidden_layers": 2,
    ...      "num_attention_heads": 2, "intermediate_size": 64, "image_size": 32,
    ...      "patch_size": 8, "num_channels": 1, "architectures": ["ViTModel"]})
    >>> hf.model["arch"], hf.model["patch_size"], hf.model["image_size"], len(hf.tensors)
    ('vit', 8, 8, 30)
    >>> hf.summary.split(", ")[-2:]
    ['positions 4x4 -> 1x1 (bicubic)', 'head fresh (a ViTModel has none)']
    """
    del tokenizer
    if hf_config is None:
        full = _full(model)
        if full.get("arch") != "vit":
            raise ConfigError(
                f"config.model.arch={full.get('arch')!r}: the classify experiment exports "
                "its ViT (arch='vit') only"
            )
        hf_config, checkpoint_grid, head = _vit_config(full), None, True
    else:
        hf_config = dict(hf_config)
        if hf_config.get("model_type") != "vit":
            raise ConfigError(
                f"a Hugging Face checkpoint of model_type={hf_config.get('model_type')!r}: "
                "the classify experiment reads 'vit' (ViTModel, ViTForImageClassification)"
            )
        model = {**model, **_vit_keys(hf_config)}
        checkpoint_size = _side(hf_config.get("image_size", 224))
        if model.get("image_size") is None:  # the run's images: the checkpoint's size
            model["image_size"] = checkpoint_size
        full = _full(model)
        checkpoint_grid = checkpoint_size // full["patch_size"]
        head = (
            CLASSIFIER in (hf_config.get("architectures") or [])
            and _labels(hf_config) == full["num_classes"]
        )
    tensors = _tensors(full, checkpoint_grid, head)
    return HFLayout(
        model=dict(model),
        config=hf_config,
        summary=_summary(hf_config, full, checkpoint_grid, head),
        tensors=tuple(tensors),
        prefix="vit.",
    )


def _full(model: Mapping[str, Any]) -> dict[str, Any]:
    """The model keys with the ViT's defaults beneath (``num_classes`` the classifier's)."""
    fields = {
        f.name: f.default
        for f in dataclasses.fields(ViT)
        if f.name not in ("parent", "name") and f.default is not dataclasses.MISSING
    }
    fields.update(num_classes=10, image_size=None)
    return {**fields, **model}


def _side(size: Any) -> int:
    """``image_size`` of ``config.json``: an int, or a square ``[h, w]``."""
    if isinstance(size, (list, tuple)):
        if len(set(size)) != 1:
            raise ConfigError(f"a ViT checkpoint of image_size={size}: the ViT takes square images")
        size = size[0]
    return int(size)


def _labels(hf: Mapping[str, Any]) -> int:
    return len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2))


# ---- config.json <-> model keys


def _vit_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
    activation = hf.get("hidden_act", "gelu")
    if activation != "gelu":
        raise ConfigError(
            f"a ViT checkpoint with hidden_act={activation!r}: the ViT's MLP uses the exact "
            "(erf) GELU, Hugging Face's 'gelu'"
        )
    width, heads = hf.get("hidden_size", 768), hf.get("num_attention_heads", 12)
    if width % heads:
        raise ConfigError(f"a ViT checkpoint of hidden_size={width} in {heads} heads")
    return dict(
        arch="vit", patch_size=_side(hf.get("patch_size", 16)), embed_dim=width,
        num_layers=hf.get("num_hidden_layers", 12), num_heads=heads,
        mlp_dim=hf.get("intermediate_size", 3072), norm_eps=hf.get("layer_norm_eps", 1e-12),
        qkv_bias=bool(hf.get("qkv_bias", True)), num_channels=hf.get("num_channels", 3),
    )  # fmt: skip


def _vit_config(m: Mapping[str, Any]) -> dict[str, Any]:
    classes = m["num_classes"]
    return {
        "architectures": [CLASSIFIER], "model_type": "vit", "hidden_size": m["embed_dim"],
        "num_hidden_layers": m["num_layers"], "num_attention_heads": m["num_heads"],
        "intermediate_size": m["mlp_dim"], "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0, "initializer_range": 0.02,
        "layer_norm_eps": m["norm_eps"], "image_size": m["image_size"],
        "patch_size": m["patch_size"], "num_channels": m["num_channels"],
        "qkv_bias": m["qkv_bias"], "id2label": {str(i): f"LABEL_{i}" for i in range(classes)},
        "label2id": {f"LABEL_{i}": i for i in range(classes)}, "torch_dtype": "float32",
    }  # fmt: skip


def _summary(hf: Mapping[str, Any], m: Mapping[str, Any], checkpoint_grid, head: bool) -> str:
    architecture = (hf.get("architectures") or ["?"])[0]
    grid = m["image_size"] // m["patch_size"]
    parts = [
        f"vit ({architecture}): {m['num_layers']} layers", f"width {m['embed_dim']}",
        f"{m['num_heads']} heads", f"mlp {m['mlp_dim']}", f"patch {m['patch_size']}",
        f"{m['num_channels']} channels",
    ]  # fmt: skip
    if checkpoint_grid is None or checkpoint_grid == grid:
        parts.append(f"positions {grid}x{grid}")
    else:
        parts.append(f"positions {checkpoint_grid}x{checkpoint_grid} -> {grid}x{grid} (bicubic)")
    if checkpoint_grid is None or head:
        parts.append(f"head of {m['num_classes']} classes")
    elif CLASSIFIER in (hf.get("architectures") or []):
        parts.append(
            f"head fresh ({_labels(hf)} labels in the checkpoint, {m['num_classes']} here)"
        )
    else:
        parts.append(f"head fresh (a {architecture} has none)")
    return ", ".join(parts)


# ---- tensors <-> parameters


def _map(path, names, shapes, to_ours, to_hf) -> HFTensor:
    return HFTensor(path, tuple(names), tuple(tuple(s) for s in shapes), to_ours, to_hf)


def _linear(out_features: int, in_features: int, shape: tuple[int, ...]):
    """``[out, in]`` weight <-> our ``[in, ...]`` kernel (``shape``)."""
    to_ours = lambda w: np.asarray(w).T.reshape(shape)  # noqa: E731
    to_hf = lambda x: (np.asarray(x).reshape(in_features, out_features).T,)  # noqa: E731
    return to_ours, to_hf


def _same(shape: tuple[int, ...], hf_shape: tuple[int, ...]):
    return (lambda x: np.asarray(x).reshape(shape)), (lambda x: (np.asarray(x).reshape(hf_shape),))


def _tensors(m: Mapping[str, Any], checkpoint_grid: int | None, head: bool) -> list[HFTensor]:
    E, H, M, p = m["embed_dim"], m["num_heads"], m["mlp_dim"], m["patch_size"]
    C, D, grid = m["num_channels"], m["embed_dim"] // m["num_heads"], m["image_size"] // p
    source_grid = grid if checkpoint_grid is None else checkpoint_grid
    rows = 1 + source_grid * source_grid
    e = "vit.embeddings."
    tensors = [
        _map("patch_embedding/kernel", [f"{e}patch_embeddings.projection.weight"], [(E, C, p, p)],
             lambda w: np.asarray(w).transpose(2, 3, 1, 0),
             lambda x: (np.asarray(x).transpose(3, 2, 0, 1),)),
        _map("patch_embedding/bias", [f"{e}patch_embeddings.projection.bias"], [(E,)],
             *_same((E,), (E,))),
        _map("cls_token", [f"{e}cls_token"], [(1, 1, E)], *_same((E,), (1, 1, E))),
        _map("position_embedding", [f"{e}position_embeddings"], [(1, rows, E)],
             lambda x: resize_position_embedding(np.asarray(x)[0], grid),
             lambda x: (np.asarray(x)[None],)),
        _map("ln_final/scale", ["vit.layernorm.weight"], [(E,)], *_same((E,), (E,))),
        _map("ln_final/bias", ["vit.layernorm.bias"], [(E,)], *_same((E,), (E,))),
    ]  # fmt: skip
    for i in range(m["num_layers"]):
        tensors += _block_tensors(
            f"block_{i}", f"vit.encoder.layer.{i}.", E, H, D, M, m["qkv_bias"]
        )
    if head:
        K = m["num_classes"]
        tensors.append(_map("head/kernel", ["classifier.weight"], [(K, E)], *_linear(K, E, (E, K))))
        tensors.append(_map("head/bias", ["classifier.bias"], [(K,)], *_same((K,), (K,))))
    return tensors


def _block_tensors(block: str, layer: str, E, H, D, M, qkv_bias: bool) -> list[HFTensor]:
    a = f"{layer}attention.attention."
    qkv = [f"{a}{x}.weight" for x in ("query", "key", "value")]

    def qkv_in(*ws):  # three [E, E] (out, in) -> [E, 3, H, D]
        return np.stack([np.asarray(w).T.reshape(E, H, D) for w in ws], axis=1)

    def qkv_out(x):
        return tuple(np.asarray(x)[:, i].reshape(E, E).T for i in range(3))

    tensors = [_map(f"{block}/attention/qkv_kernel", qkv, [(E, E)] * 3, qkv_in, qkv_out)]
    if qkv_bias:
        tensors.append(_map(
            f"{block}/attention/qkv_bias", [f"{a}{x}.bias" for x in ("query", "key", "value")],
            [(E,)] * 3, lambda *bs: np.stack([np.asarray(b).reshape(H, D) for b in bs]),
            lambda x: tuple(np.asarray(row).reshape(E) for row in np.asarray(x)),
        ))  # fmt: skip
    per_layer = [
        ("attention/out_kernel", "attention.output.dense.weight", (E, E), _linear(E, E, (H, D, E))),
        ("attention/out_bias", "attention.output.dense.bias", (E,), _same((E,), (E,))),
        ("ln_attention/scale", "layernorm_before.weight", (E,), _same((E,), (E,))),
        ("ln_attention/bias", "layernorm_before.bias", (E,), _same((E,), (E,))),
        ("ln_mlp/scale", "layernorm_after.weight", (E,), _same((E,), (E,))),
        ("ln_mlp/bias", "layernorm_after.bias", (E,), _same((E,), (E,))),
        ("mlp/fc/kernel", "intermediate.dense.weight", (M, E), _linear(M, E, (E, M))),
        ("mlp/fc/bias", "intermediate.dense.bias", (M,), _same((M,), (M,))),
        ("mlp/proj/kernel", "output.dense.weight", (E, M), _linear(E, M, (M, E))),
        ("mlp/proj/bias", "output.dense.bias", (E,), _same((E,), (E,))),
    ]
    for path, name, shape, (to_ours, to_hf) in per_layer:
        tensors.append(_map(f"{block}/{path}", [layer + name], [shape], to_ours, to_hf))
    return tensors
