"""The fast defaults for CPU hosts, switchable one by one for the benchmarks.

All of them now live in `replicator.spmd.cpu`, which the Replicator applies on CPU
meshes (the malloc setting only where a process holds several devices); here
they can be switched one by one.

Each of the three changes leaves the user's model code alone; their gains are
measured side by side in ``benchmarks/throughput.py``.

1. `keep_freed_memory`: XLA:CPU allocates one temp buffer per execution (56-230
   MB for the tutorial CNN at batch 256). glibc serves blocks that large with
   ``mmap`` and gives them back with ``munmap`` when the step ends, so every step
   page-faults its whole working set in again (and in this Firecracker VM the
   host may have reclaimed the pages in between). ``mallopt`` keeps freed memory
   in the process instead.
2. `COMPILER_OPTIONS`: this jaxlib sends convolutions to YNNPACK by default,
   which is 2-3x slower than Eigen on these shapes (a 3x3 conv with 1 or 32 input
   channels and its weight gradient). Keep YNNPACK for dots only.
3. `install_max_pool_lowering`: a max pool whose windows do not overlap (window
   == stride, no padding, e.g. ``nn.max_pool(x, (2, 2), strides=(2, 2))``) is
   lowered to strided slices and elementwise max; its gradient
   (``select_and_scatter_add``) to "route the cotangent to the first maximum of
   each window", with the same tie-breaking as XLA's select-and-scatter. XLA:CPU
   expands select-and-scatter into four full-size iotas, a variadic reduce-window
   and a scatter, which alone took 40-50% of the step.
"""

from __future__ import annotations

import jax

from replicator.spmd.cpu import (  # noqa: F401
    COMPILER_OPTIONS,
    install_max_pool_lowering,
    keep_freed_memory,
)

# Convolutions on Eigen, dots on YNNPACK. Pass as jax.jit(..., compiler_options=...),
# or as XLA_FLAGS="--xla_cpu_experimental_ynn_fusion_type=individual_dot".
XLA_FLAGS = "--xla_cpu_experimental_ynn_fusion_type=individual_dot"
# With several devices in a process, replicator.spmd.cpu also picks the memory-optimized
# scheduler (replicator.spmd.cpu.SEVERAL_DEVICES_OPTIONS).
SEVERAL_DEVICES_XLA_FLAGS = "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"


def xla_flags(devices_per_process: int) -> str:
    """Replicator's CPU compiler options for this many devices per process, as XLA_FLAGS."""
    return XLA_FLAGS + (f" {SEVERAL_DEVICES_XLA_FLAGS}" if devices_per_process > 1 else "")


def apply_process_defaults() -> dict[str, bool]:
    """The process-wide half of the proposal (malloc and max-pool lowering)."""
    if jax.default_backend() != "cpu":
        return {"keep_freed_memory": False, "max_pool_lowering": False}
    kept = keep_freed_memory()
    install_max_pool_lowering()
    return {"keep_freed_memory": kept, "max_pool_lowering": True}
