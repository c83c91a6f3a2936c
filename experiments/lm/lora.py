"""LoRA and QLoRA adapters on the LM's projection kernels, written in the model.

LoRA (Hu et al. 2021) adds to a frozen kernel ``W`` a trained low-rank product: a
projection ``y = x W`` becomes ``y = x W + (alpha / rank) * dropout(x) A B``. The
model keys ``lora_rank`` (0: off), ``lora_alpha``, ``lora_dropout`` and
``lora_targets`` (a regex searched in the kernels' parameter paths, as ``python -m
replicator params`` prints them: ``blocks/attention/q_kernel``, ``block_3/mlp/up/kernel``)
choose them; `PROJECTIONS` says which kernels can take one (attention's q/kv/qkv/out, the
MLP's fc/proj/gate/up/down: not embeddings, norms, the head or a mixture of experts).

Each adapter sits beside its kernel, ``<kernel>_lora_a`` and ``<kernel>_lora_b``, so
that the frozen set is every parameter but those (``FROZEN_BY_LORA``, which the LM's
config freezes by itself). Its axes follow the kernel's: ``A`` takes the kernel's input
axes (what the product contracts) and ``B`` its output axes, each with a rank axis
(logical name None), so the sharding rules split them as they split their kernel. A
fused kernel (``kv_kernel [E, 2, K, D]``, ``qkv_kernel [E, 3, H, D]``) has one adapter
per slot, as Hugging Face PEFT has one per module (k apart from v): ``A [E, 2, r]``,
``B [2, r, K, D]``. ``A`` starts as PEFT's default (Kaiming uniform, bound
``1 / sqrt(fan_in)``), ``B`` at zero, so a fresh adapter changes nothing.

QLoRA (Dettmers et al. 2023; ``lora_quantize``): the targeted kernels are stored
quantized, ``'int8'`` or ``'nf4'`` (the paper's 4-bit NormalFloat levels, two codes per
byte), with one float32 absmax scale per block of `BLOCK` numbers along the kernel's last
axis (``<kernel>_scale``), and dequantized for the product. Codes and scales keep the
kernel's logical axes: sharded like the kernel.

Why not qwix: its LoRA einsum sets an attribute on the module (``SetAttributeFrozenModuleError``
in our ``@nn.compact`` layers) and intercepts the ``jax.eval_shape`` that the layers'
products use; only its ``dot_general`` path (the MLP) works under ``nn.scan``. Its NF4
codes are int4 arrays, which Orbax does not keep; here they are packed into uint8.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.dtypes import promote_dtype

if TYPE_CHECKING:
    from experiments.lm.model import Transformer

QUANTIZATIONS = ("int8", "nf4")
BLOCK = 64  # numbers per absmax scale (the QLoRA paper's block)
ADAPTERS = ("_lora_a", "_lora_b")
SCALE = "_scale"
# Every parameter but the adapters: what LoRA freezes (paths as `params` prints them).
FROZEN_BY_LORA = r"^(?!.*_lora_[ab]$)"
# The kernels that can take an adapter: the attention's and the dense MLP's projections.
PROJECTIONS = re.compile(r"(^|/)(attention/\w*kernel|mlp/\w+/kernel)$")
# The 16 NormalFloat levels of the QLoRA paper (its appendix E), ascending.
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What the layers need of the LoRA keys (hashable: a module attribute).

    Attributes:
      rank: the adapters' rank (> 0).
      alpha: their product is scaled by ``alpha / rank``.
      dropout: dropout rate on an adapter's input, in training.
      targets: the regex over the kernels' paths.
      quantize: None, ``'int8'`` or ``'nf4'``: how the targeted kernels are stored.
      adapters: False computes the base model (the adapters left out, still made at init).
      deterministic: no dropout (not training).
    """

    rank: int
    alpha: float
    dropout: float
    targets: str
    quantize: str | None = None
    adapters: bool = True
    deterministic: bool = True

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def spec_of(model: Transformer, train: bool, adapters: bool = True) -> LoraSpec | None:
    """``model``'s `LoraSpec` for one call (None without LoRA)."""
    if not model.lora_rank:
        return None
    return LoraSpec(
        model.lora_rank, model.lora_alpha, model.lora_dropout, model.lora_targets,
        model.lora_quantize, adapters, not train,
    )  # fmt: skip


def is_target(path: str, targets: str) -> bool:
    """Whether the parameter at ``path`` (``blocks/attention/q_kernel``) takes an adapter.

    >>> is_target("blocks/attention/q_kernel", "attention/q_")
    True
    >>> is_target("blocks/ln_mlp/scale", ".*"), is_target("head/kernel", "kernel")
    (False, False)
    """
    return bool(PROJECTIONS.search(path)) and re.search(targets, path) is not None


def _targeted(module: nn.Module, name: str, spec: LoraSpec | None, made: str) -> bool:
    """Whether kernel ``name`` of ``module`` has the parameter ``name + made``: at init by
    the targets regex, after it by the parameters there are (a pipeline's stages apply
    blocks outside their path)."""
    if spec is None:
        return False
    if module.is_initializing():
        return is_target("/".join((*module.path, name)), spec.targets)
    return module.has_variable("params", name + made)


# ---------------------------------------------------------------- the kernels


def kernel(
    module: nn.Module, name: str, init: Any, shape: tuple[int, ...], names: tuple,
    spec: LoraSpec | None,
) -> jax.Array:  # fmt: skip
    """The kernel parameter ``name`` of ``module``, as floats: made by ``init`` (an
    unboxed initializer) with logical axes ``names``, or, where QLoRA stores it, its codes
    and ``name + '_scale'`` (`quantize` of ``init``'s draw), dequantized."""
    quantized = spec is not None and spec.quantize is not None
    if not (quantized and _targeted(module, name, spec, SCALE)):
        return module.param(name, nn.with_logical_partitioning(init, names), shape)
    # One draw for both parameters; after init flax only traces these for their shapes.
    key = module.make_rng("params") if module.is_initializing() else jax.random.key(0)

    def made(part: int) -> Any:
        draw = lambda _: quantize(init(key, shape, jnp.float32), spec.quantize)[part]  # noqa: E731
        return nn.with_logical_partitioning(draw, names)

    codes, scale = module.param(name, made(0)), module.param(name + SCALE, made(1))
    return dequantize(codes, scale, spec.quantize)


def delta(
    module: nn.Module, name: str, equation: str, x: jax.Array, shape: tuple[int, ...],
    names: tuple, spec: LoraSpec | None, gathered: Any = None,
) -> jax.Array | None:  # fmt: skip
    """The adapter's term ``(alpha / rank) * dropout(x) A B`` for kernel ``name`` (of
    ``shape``, logical axes ``names``) used as ``einsum(equation, x, kernel)``; None where
    the kernel has no adapter or ``spec.adapters`` is False (`Layout`). ``gathered(w,
    logical_names)`` places ``A`` and ``B`` for the products (None: as they are)."""
    if not _targeted(module, name, spec, ADAPTERS[0]):
        return None
    at = Layout.of(equation, shape, names, spec.rank)
    a_init = _kaiming_uniform(at.fan_in)
    a = module.param(name + ADAPTERS[0], nn.with_logical_partitioning(a_init, at.a_names), at.a)
    b_init = nn.initializers.zeros_init()
    b = module.param(name + ADAPTERS[1], nn.with_logical_partitioning(b_init, at.b_names), at.b)
    if not spec.adapters:
        return None
    x, a, b = promote_dtype(_dropped(module, x, spec), a, b, dtype=module.dtype)
    if gathered is not None:
        a, b = gathered(a, at.a_names), gathered(b, at.b_names)
    h = jnp.einsum(at.first, x, a)
    return jnp.einsum(at.second, h, b) * jnp.asarray(spec.scale, h.dtype)


@dataclasses.dataclass(frozen=True)
class Layout:
    """An adapter's shapes, logical axes and products for a kernel used as
    ``einsum(equation, x, kernel)``.

    ``A`` takes the kernel's contracted axes, its slots (axes of logical name None that
    the output keeps: a fused kernel's q/k/v index) and the rank; ``B`` the slots, the
    rank and the other output axes; ``first`` and ``second`` are the einsums
    ``x, A -> h`` and ``h, B -> y``.

    >>> at = Layout.of("bte,ekhd->btkhd", (8, 2, 4, 3), ("embed", None, "heads", "kv"), 5)
    >>> at.a, at.a_names, at.b, at.b_names
    ((8, 2, 5), ('embed', None, None), (2, 5, 4, 3), (None, None, 'heads', 'kv'))
    >>> at.first, at.second
    ('bte,ekr->btkr', 'btkr,krhd->btkhd')
    """

    a: tuple[int, ...]
    b: tuple[int, ...]
    a_names: tuple
    b_names: tuple
    first: str
    second: str
    fan_in: int

    @classmethod
    def of(cls, equation: str, shape: tuple[int, ...], names: tuple, rank: int) -> Layout:
        inputs, out = equation.replace(" ", "").split("->")
        x_in, k_in = inputs.split(",")
        contracted = [i for i, c in enumerate(k_in) if c in x_in]
        slots = [i for i, c in enumerate(k_in) if c not in x_in and names[i] is None]
        outs = [i for i, c in enumerate(k_in) if c not in x_in and names[i] is not None]
        r = next(c for c in "rqpzyw" if c not in equation)
        letters = lambda axes: "".join(k_in[i] for i in axes)  # noqa: E731
        hidden = "".join(c for c in x_in if c not in k_in) + letters(slots) + r
        return cls(
            a=(*(shape[i] for i in contracted + slots), rank),
            b=(*(shape[i] for i in slots), rank, *(shape[i] for i in outs)),
            a_names=(*(names[i] for i in contracted), *(None for _ in slots), None),
            b_names=(*(None for _ in slots), None, *(names[i] for i in outs)),
            first=f"{x_in},{letters(contracted + slots)}{r}->{hidden}",
            second=f"{hidden},{letters(slots)}{r}{letters(outs)}->{out}",
            fan_in=math.prod(shape[i] for i in contracted),
        )


def _kaiming_uniform(fan_in: int) -> Any:
    """PEFT's ``lora_A`` init (``kaiming_uniform_(a=sqrt(5))``): uniform in ``+-1/sqrt(fan_in)``."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(rng, shape, dtype=jnp.float32):
        return jax.random.uniform(rng, shape, dtype, -bound, bound)

    return init


def _dropped(module: nn.Module, x: jax.Array, spec: LoraSpec) -> jax.Array:
    """``x`` with the adapter's dropout (training only; the ``dropout`` rng)."""
    if spec.deterministic or not spec.dropout:
        return x
    keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - spec.dropout, x.shape)
    return jnp.where(keep, x / (1.0 - spec.dropout), 0.0).astype(x.dtype)


# -------------------------------------------------------- QLoRA's storage


def block_size(n: int) -> int:
    """Numbers per scale along an axis of ``n``: `BLOCK`, or the largest power of two
    dividing ``n`` below it.

    >>> block_size(4096), block_size(96), block_size(8)
    (64, 32, 8)
    """
    return math.gcd(n, BLOCK)


def quantize(w: Any, kind: str, xp: Any = jnp) -> tuple[Any, Any]:
    """``w``'s codes and scales: blockwise absmax (`block_size` along the last axis).

    Args:
      w: the float kernel.
      kind: ``'int8'`` (codes ``round(127 x / absmax)``, int8) or ``'nf4'`` (the
        nearest of `NF4_LEVELS` to ``x / absmax``, two 4-bit codes per uint8, the even
        position in the low half).
      xp: ``jax.numpy``, or ``numpy`` on the host (``init_from='hf:DIR'``).

    Returns:
      ``(codes, scales)``: codes ``w.shape`` (int8) or with the last axis halved (uint8);
      float32 scales with the last axis divided by the block.

    >>> codes, scale = quantize(np.array([[0.5, -1.0]]), "int8", np)
    >>> codes.tolist(), scale.tolist(), dequantize(codes, scale, "int8", np).tolist()
    ([[64, -127]], [[0.007874015718698502]], [[0.5039370059967041, -1.0]])
    """
    w = xp.asarray(w, xp.float32)
    n = w.shape[-1]
    blocks = w.reshape(*w.shape[:-1], n // block_size(n), block_size(n))
    absmax = xp.max(xp.abs(blocks), axis=-1, keepdims=True)
    absmax = xp.where(absmax == 0, xp.ones_like(absmax), absmax)
    if kind == "int8":
        scale = absmax / 127.0
        codes = xp.clip(xp.round(blocks / scale), -127, 127).astype(xp.int8)
        return codes.reshape(w.shape), scale[..., 0]
    if kind != "nf4":
        raise ValueError(f"lora_quantize={kind!r}: use one of {QUANTIZATIONS}.")
    if n % 2:
        raise ValueError(f"nf4 packs two codes a byte along the last axis: {n} is odd.")
    midpoints = xp.asarray((NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2)
    index = xp.searchsorted(midpoints, (blocks / absmax).reshape(-1)).astype(xp.uint8)
    pairs = index.reshape(*w.shape[:-1], n // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), absmax[..., 0]


def dequantize(codes: Any, scale: Any, kind: str, xp: Any = jnp) -> Any:
    """The kernel `quantize` stored, in ``scale``'s dtype."""
    if kind == "nf4":
        index = xp.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
        values = xp.asarray(NF4_LEVELS)[index.astype(xp.int32)]
    else:
        values = codes
    n = values.shape[-1]
    blocks = values.reshape(*values.shape[:-1], scale.shape[-1], n // scale.shape[-1])
    return (blocks.astype(scale.dtype) * scale[..., None]).reshape(values.shape)


def merge(w: Any, a: Any, b: Any, scale: float, xp: Any = np) -> Any:
    """``w + scale * A B``: the kernel with its adapter in it (``A`` and ``B`` laid out as
    `delta` makes them: the kernel is ``[inputs..., slots..., outputs...]``).

    >>> merge(np.zeros((2, 3)), np.ones((2, 1)), np.ones((1, 3)), 0.5).tolist()
    [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]
    """
    slots = a.ndim + b.ndim - w.ndim - 2
    n_in, n_out = a.ndim - slots - 1, b.ndim - slots - 1
    i, s, o = "abcd"[:n_in], "ijk"[:slots], "uvwx"[:n_out]
    product = xp.einsum(f"{i}{s}r,{s}r{o}->{i}{s}{o}", a, b)
    return (xp.asarray(w, xp.float32) + scale * product).astype(xp.asarray(w).dtype)


# ------------------------------------------------------------- the checks


def key_problems(model: Transformer) -> list[str]:
    """The LoRA keys' values that cannot work, one line each (no tracing: the model's
    own check, `lora_problems` adds those that need its parameters)."""
    rank, problems = model.lora_rank, []
    if not isinstance(rank, int) or rank < 0:
        return [f"config.model.lora_rank={rank!r} must be an int >= 0 (0: no LoRA)"]
    if not rank:
        if model.lora_quantize is not None:
            problems.append(
                f"config.model.lora_quantize={model.lora_quantize!r} quantizes the kernels "
                "that take adapters: set config.model.lora_rank > 0 too"
            )
        return problems
    if not model.lora_alpha > 0:
        problems.append(f"config.model.lora_alpha={model.lora_alpha} must be > 0")
    if not 0 <= model.lora_dropout < 1:
        problems.append(f"config.model.lora_dropout={model.lora_dropout} must be in [0, 1)")
    if model.lora_quantize not in (None, *QUANTIZATIONS):
        problems.append(
            f"config.model.lora_quantize={model.lora_quantize!r}: use None, 'int8' or 'nf4'"
        )
    try:
        re.compile(model.lora_targets)
    except (re.error, TypeError) as e:
        problems.append(f"config.model.lora_targets={model.lora_targets!r} is no regex: {e}")
    return problems


def lora_problems(model: Transformer, stages: int | None = None) -> list[str]:
    """What LoRA cannot run as ``model`` says, one line each, before anything is written.

    Beside `key_problems`: a targets regex that finds no projection kernel (the lines
    name them), nf4 on a kernel whose last axis is odd, and dropout on the adapters
    under a pipeline of ``stages`` > 1 (whose stages take no dropout rng).

    Args:
      model: the LM (`experiments.lm.model.Transformer`).
      stages: the ``stage`` mesh axis's size, or None.

    Returns:
      The problems (empty: none).
    """
    problems = key_problems(model)
    if problems or not model.lora_rank:
        return problems
    shapes = kernel_shapes(model)
    found = {p: s for p, s in shapes.items() if re.search(model.lora_targets, p)}
    if not found:
        names = sorted({re.sub(r"^(blocks|block_\d+)/", "", p) for p in shapes})
        return [
            f"config.model.lora_targets={model.lora_targets!r} matches no projection kernel; "
            f"they are {', '.join(names)} under blocks/ (scanned) or block_<i>/"
        ]
    if model.lora_quantize == "nf4":
        odd = sorted(p for p, s in found.items() if s[-1] % 2)
        if odd:
            problems.append(
                f"config.model.lora_quantize='nf4' packs two codes a byte along a kernel's last "
                f"axis, odd in {', '.join(odd)}: use 'int8'"
            )
    if stages and stages > 1 and model.lora_dropout:
        problems.append(
            "config.model.lora_dropout: a pipeline ('stage' axis) runs no dropout yet: set it to 0"
        )
    return problems


def kernel_shapes(model: Transformer) -> dict[str, tuple[int, ...]]:
    """Every projection kernel that can take an adapter: path (as `params` prints it) ->
    one layer's shape (no arrays made)."""
    base = model.clone(lora_rank=0, lora_quantize=None, parent=None)
    tokens = jnp.zeros((1, min(8, base.max_len)), jnp.int32)
    params = jax.eval_shape(lambda: base.init(jax.random.key(0), tokens))["params"]
    flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(params))[0]
    shapes = {}
    for keys, leaf in flat:
        path = "/".join(str(getattr(k, "key", k)) for k in keys)
        if PROJECTIONS.search(path):
            shapes[path] = tuple(leaf.shape[1:] if path.startswith("blocks/") else leaf.shape)
    return shapes
