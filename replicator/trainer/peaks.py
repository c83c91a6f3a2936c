"""The matmul peak that MFU is measured against: vendors' data sheets for
accelerators, a matmul measured now on CPUs (whose peak depends on the host)."""

from __future__ import annotations

import math
import time

import jax
import numpy as np

from replicator.compiled.topology import chip_spec


def data_sheet_peak(device_kind: str) -> tuple[float, str] | None:
    """The dense bf16 matmul peak of one chip of ``device_kind`` and its source, or
    None for a chip not in the table (CPUs included). The peaks live in the one
    table of chip specs, `replicator.compiled.topology.CHIPS`.

    >>> data_sheet_peak("NVIDIA H100 80GB HBM3")
    (989000000000000.0, 'NVIDIA H100 bf16 data sheet')
    >>> data_sheet_peak("TPU v5 lite")
    (197000000000000.0, 'TPU v5e bf16 data sheet')
    """
    chip = chip_spec(device_kind)
    if chip is None or chip.bf16_flops_per_s is None:
        return None
    return chip.bf16_flops_per_s, f"{chip.name} bf16 data sheet"


def peak_flops_per_second(devices: list[jax.Device]) -> tuple[float, str] | None:
    """The matmul peak of ``devices`` together, and where the number comes from.

    Accelerators: the data-sheet dense bf16 peak of their chip (`replicator.compiled.topology`)
    times their count. CPUs: an f32 matmul measured now on one of this process's devices
    (chains of dependent 1024x1024 products, best of a few rounds, about
    0.3 s), times the number of hosts (`_num_hosts`): a host's CPU devices
    share its cores, and every host is taken to be like this one.

    Returns:
      ``(flops_per_second, source)``, or None for an accelerator not in the table.
    """
    if devices[0].platform == "cpu":
        local = [d for d in devices if d.process_index == jax.process_index()]
        return _num_hosts(devices) * measure_matmul_flops(local[0]), "measured f32 matmul"
    peak = data_sheet_peak(devices[0].device_kind)
    if peak is None:
        return None
    # Per device: a chip whose TensorCores are separate devices (TPU7x) shares its peak.
    per_device = chip_spec(devices[0].device_kind).per_device(peak[0])
    return len(devices) * per_device, peak[1]


def _num_hosts(devices: list[jax.Device]) -> int:
    """Hosts under ``devices``: one per process, unless the coordinator is this host's
    loopback (``launch local``), where every process shares this host's cores."""
    from replicator.runtime.compat import coordinator_address
    from replicator.runtime.processes import is_loopback, split_address

    address = coordinator_address()
    if address and is_loopback(split_address(address)[0]):
        return 1
    return len({d.process_index for d in devices})


def measure_matmul_flops(device: jax.Device, n: int = 1024, rounds: int = 5) -> float:
    """Best f32 matmul rate of ``device`` in FLOP/s, over ``rounds`` chains of 4 products."""
    rng = np.random.default_rng(0)
    a = jax.device_put(rng.standard_normal((n, n), np.float32), device)
    b = jax.device_put(rng.standard_normal((n, n), np.float32) / np.sqrt(n), device)
    chain = jax.jit(lambda a, b: jax.lax.fori_loop(0, 4, lambda i, c: c @ b, a))
    chain(a, b).block_until_ready()  # compile
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        chain(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 4 * 2 * n**3 / best
