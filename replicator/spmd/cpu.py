"""Fast defaults for CPU hosts, measured in docs/benchmarks.md; the model code is unchanged.

* `install_max_pool_lowering`: a max pool whose windows do not overlap (window
  == stride, no padding, e.g. ``nn.max_pool(x, (2, 2), strides=(2, 2))``) is
  lowered to strided slices and an elementwise max, and its gradient
  (``select_and_scatter_add``) to "send the cotangent to the first maximum of
  each window", XLA's own tie-breaking, so results are bitwise the same. XLA:CPU
  expands select-and-scatter into four full-size iotas, a variadic
  reduce-window and a scatter, which took 40-50% of the tutorial CNN's step.
  Registered for the CPU platform only; other windows keep JAX's lowering.
* `COMPILER_OPTIONS`: this jaxlib sends convolutions to YNNPACK, 1.6-3.6x slower
  than Eigen on small-channel convolutions; keep YNNPACK for dots only.
* When a process runs several CPU devices, their steps run side by side and
  each allocates and frees its temp buffers (tens of MB) every step. glibc
  serves such blocks with ``mmap`` and returns them with ``munmap``, so every
  step faults its pages in again, and the devices' threads queue on the
  kernel's memory map lock: `keep_freed_memory` (the tutorial CNN on 2 devices:
  1.8x). On 1 device it does not pay (0.9-1.0x). XLA's memory-optimized
  scheduler (``xla_cpu_scheduler_type``) was a default here too (1.24x without
  the malloc setting, neutral with it), until it crashed or deadlocked XLA:CPU on
  a program with collectives over two mesh axes (the MoE LM under `run` on
  ``{'expert': 2, 'data': 4}``, reducing its sums over ``data``; it runs with
  JAX's scheduler). ``benchmarks/conv_study.py`` found that no matmul
  formulation of the convolutions beats Eigen's.

`configure` applies all of it for a set of devices; the Replicator calls it.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import itertools
import os

import jax.numpy as jnp
from jax import lax
from jax.interpreters import mlir

from replicator.runtime import compat

COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def configure(devices) -> dict[str, str] | None:
    """Applies the CPU defaults for a mesh of ``devices``; their compiler options.

    Off CPU: nothing, and None. On CPU: installs the max-pool lowering, and
    when one process holds several of ``devices`` keeps freed memory
    (process-wide); returns the options for `jax.jit`.
    """
    if not all(d.platform == "cpu" for d in devices):
        return None
    install_max_pool_lowering()
    options = dict(COMPILER_OPTIONS)
    if _several_per_process(devices):
        keep_freed_memory()
    return options


def needs_bounded_dispatch(devices) -> bool:
    """Whether steps over ``devices`` must not queue without bound: a mesh of several
    CPU devices, where a long queue of sharded steps has deadlocked XLA:CPU's
    collective rendezvous. GPUs and TPUs queue work on their own streams."""
    return len(devices) > 1 and all(d.platform == "cpu" for d in devices)


def _several_per_process(devices) -> bool:
    per_process = collections.Counter(d.process_index for d in devices)
    return max(per_process.values(), default=0) > 1


_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Makes glibc malloc keep freed memory for reuse instead of unmapping it.

    Process-wide, for later allocations; large blocks then come from the heap
    instead of ``mmap``, and freed memory is not trimmed. The cost: the process
    keeps its peak heap, which a training loop reaches every step anyway.

    Returns:
      Whether it took effect: False where the C library is not glibc.
    """
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):  # not a POSIX system that knows it
        glibc = ""
    if not glibc.startswith("glibc"):
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def _non_overlapping(window_dimensions, window_strides, padding, *dilations) -> bool:
    return (
        tuple(window_dimensions) == tuple(window_strides)
        and all(tuple(p) == (0, 0) for p in padding)
        and all(d == 1 for dil in dilations for d in dil)
    )


def _window_slices(operand, window, out_shape):
    """The operand's elements at each offset of the window, one array per offset."""
    return [
        operand[tuple(slice(o, o + n * w, w) for o, n, w in zip(offset, out_shape, window))]
        for offset in itertools.product(*(range(w) for w in window))
    ]


def _max_pool(operand, *, window_dimensions):
    window = tuple(window_dimensions)
    out_shape = tuple((d - w) // w + 1 for d, w in zip(operand.shape, window))
    return functools.reduce(jnp.maximum, _window_slices(operand, window, out_shape))


def _max_pool_grad(source, operand, *, window_dimensions):
    window, out_shape = tuple(window_dimensions), source.shape
    parts = _window_slices(operand, window, out_shape)
    best = functools.reduce(jnp.maximum, parts)
    zero = jnp.zeros((), source.dtype)
    taken, routed = None, []
    for part in parts:  # window offsets in row-major order: the first maximum wins
        hit = part == best
        routed.append(jnp.where(hit if taken is None else hit & ~taken, source, zero))
        taken = hit if taken is None else taken | hit
    rank = len(out_shape)
    grad = jnp.stack(routed, axis=-1).reshape(out_shape + window)
    interleave = [a for i in range(rank) for a in (i, rank + i)]
    grad = grad.transpose(interleave).reshape([n * w for n, w in zip(out_shape, window)])
    tail = [(0, d - n * w, 0) for d, n, w in zip(operand.shape, out_shape, window)]
    return lax.pad(grad, zero, tail) if any(hi for _, hi, _ in tail) else grad


def _lowering_rule(prim, platform: str):
    # JAX keeps registered lowerings in private tables: see runtime.compat.
    return compat.lowering_rule(prim, platform)


def _reduce_window_max_lowering(default_rule, ctx, operand, **params):
    window = params["window_dimensions"]
    dilations = (params["base_dilation"], params["window_dilation"])
    if _non_overlapping(window, params["window_strides"], params["padding"], *dilations):
        pool = functools.partial(_max_pool, window_dimensions=window)
        return mlir.lower_fun(pool, multiple_results=False)(ctx, operand)
    return default_rule(ctx, operand, **params)


def _select_and_scatter_add_lowering(default_rule, ctx, source, operand, **params):
    if params["select_prim"] is lax.ge_p and _non_overlapping(
        params["window_dimensions"], params["window_strides"], params["padding"]
    ):
        grad = functools.partial(_max_pool_grad, window_dimensions=params["window_dimensions"])
        return mlir.lower_fun(grad, multiple_results=False)(ctx, source, operand)
    return default_rule(ctx, source, operand, **params)


_installed = False


def install_max_pool_lowering() -> None:
    """Registers the CPU lowerings of max pool and its gradient described above.

    Process-wide; applies to every computation lowered afterwards. Other
    reduce-window / select-and-scatter uses keep JAX's own lowering.
    """
    global _installed
    if _installed:
        return
    pool, pool_grad = compat.max_pool_primitives()
    for prim, rule in (
        (pool, _reduce_window_max_lowering),
        (pool_grad, _select_and_scatter_add_lowering),
    ):
        default_rule = _lowering_rule(prim, "cpu")
        mlir.register_lowering(prim, functools.partial(rule, default_rule), platform="cpu")
    _installed = True
