"""Cloud TPU slices without the hardware: accelerator names, their devices, chip specs.

libtpu (the ``tpu`` extra, ``jax[tpu]``) compiles for any Cloud TPU topology on
any machine. `devices` turns a gcloud accelerator name (``v5p-128``,
``v5litepod-16``, ``v6e-256``) into the devices of that slice, or of several
slices, which a `Replicator` lays its mesh over as it would over a real pod;
steps lowered and compiled there give the TPU compiler's own program (memory,
HLO), and nothing runs. ``python -m replicator compile`` is built on it.

`CHIPS` is the one table of chip specs (peak, memory, bandwidths, each with its
source), which the trainer's MFU (`replicator.trainer.peaks`) and the compile
command's roofline read through `chip_spec`.

>>> accelerator("v5p-128").topology, accelerator("v5p-128").chips
('v5:4x4x4', 64)
>>> accelerator("v5litepod-16").topology, chip_spec("TPU v5 lite").name
('v5e:4x4', 'TPU v5e')
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import os
import re
from collections.abc import Iterator

import jax

from replicator.errors import TopologyError

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One kind of chip, per chip unless said otherwise (None: not known).

    Attributes:
      name: e.g. ``"TPU v5e"``.
      device_kinds: the ``jax.Device.device_kind`` values (or their starts) of it.
      bf16_flops_per_s: dense bf16 matmul peak.
      hbm_bytes: HBM capacity (data sheet).
      hbm_bytes_per_s: HBM bandwidth.
      ici_bytes_per_s: inter-chip interconnect bandwidth, both directions together.
      dcn_bytes_per_s: data center network bandwidth of one host.
      chips_per_host: chips one host (TPU VM) drives.
      devices_per_chip: JAX devices per chip (TPU7x shows its 2 TensorCores as 2).
      usable_hbm_bytes: what the TPU compiler lets one device's program use (libtpu
        0.0.42's out-of-memory message), the bound `compile` checks a step against.
      source: where the numbers come from.
    """

    name: str
    device_kinds: tuple[str, ...]
    bf16_flops_per_s: float | None
    hbm_bytes: int | None = None
    hbm_bytes_per_s: float | None = None
    ici_bytes_per_s: float | None = None
    dcn_bytes_per_s: float | None = None
    chips_per_host: int | None = None
    devices_per_chip: int = 1
    usable_hbm_bytes: int | None = None
    source: str = ""

    def per_device(self, value: float | None) -> float | None:
        """A per-chip ``value`` shared by the chip's JAX devices."""
        return None if value is None else value / self.devices_per_chip


# Sources: Google Cloud's TPU pages, as of 2026 (the numbers as each page states them;
# "GB" of HBM capacity on the v5e/v6e pages is GiB: the compiler offers 15.75 and 31.25).
CHIPS: tuple[ChipSpec, ...] = (
    # https://cloud.google.com/tpu/docs/v4: 275 TFLOPs bf16, 32 GiB HBM2 at 1200 GBps, 4 chips
    # per host. ICI and DCN bandwidths: not on the page (UNSOURCED, left unknown).
    ChipSpec("TPU v4", ("TPU v4",), 275e12, 32 * GiB, 1200e9, None, None, 4,
             usable_hbm_bytes=int(30.75 * GiB), source="https://cloud.google.com/tpu/docs/v4"),
    # https://cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16, 16 GB HBM2 at 819 GBps, ICI
    # 400 GBps bidirectional per chip, 8 chips per host, per-host NIC 2 x 100 Gbps.
    ChipSpec("TPU v5e", ("TPU v5 lite", "TPU v5e"), 197e12, 16 * GiB, 819e9, 400e9, 25e9, 8,
             usable_hbm_bytes=int(15.75 * GiB), source="https://cloud.google.com/tpu/docs/v5e"),
    # https://cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16, 95 GiB HBM2e at 2765 GBps,
    # ICI 1200 GBps bidirectional per chip, DCN 50 Gbps per chip, 4-chip hosts. (The
    # compiler offers a program 95.74 GiB: the page rounds the capacity down.)
    ChipSpec("TPU v5p", ("TPU v5p", "TPU v5"), 459e12, 95 * GiB, 2765e9, 1200e9, 4 * 50e9 / 8,
             4, usable_hbm_bytes=int(95.74 * GiB), source="https://cloud.google.com/tpu/docs/v5p"),
    # https://cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16, 32 GB HBM at 1638 GBps, ICI
    # 800 GBps bidirectional per chip, 8 chips per host; DCN 100 Gbps per chip from
    # https://cloud.google.com/tpu/docs/tpu7x (its table compares v5p, v6e and TPU7x).
    ChipSpec("TPU v6e", ("TPU v6 lite", "TPU v6e"), 918e12, 32 * GiB, 1638e9, 800e9,
             8 * 100e9 / 8, 8, usable_hbm_bytes=int(31.25 * GiB),
             source="https://cloud.google.com/tpu/docs/v6e"),
    # https://cloud.google.com/tpu/docs/tpu7x: 2307 TFLOPs bf16, 192 GiB HBM at 7380 GBps,
    # ICI 1200 GBps bidirectional per chip, DCN 100 Gbps per chip, 4-chip hosts; two
    # TensorCores per chip, each a JAX device.
    ChipSpec("TPU7x", ("TPU7x",), 2307e12, 192 * GiB, 7380e9, 1200e9, 4 * 100e9 / 8, 4,
             devices_per_chip=2, usable_hbm_bytes=int(94.75 * GiB),
             source="https://cloud.google.com/tpu/docs/tpu7x"),
    # GPUs: the dense bf16 peaks of NVIDIA's data sheets (nvidia.com); the rest unknown here.
    ChipSpec("NVIDIA H200", ("NVIDIA H200",), 989e12, source="NVIDIA H200 data sheet"),
    ChipSpec("NVIDIA H100", ("NVIDIA H100",), 989e12,  # SXM; the PCIe card peaks at 756e12
             source="NVIDIA H100 data sheet"),
    ChipSpec("NVIDIA A100", ("NVIDIA A100",), 312e12, source="NVIDIA A100 data sheet"),
    ChipSpec("NVIDIA L4", ("NVIDIA L4",), 121e12, source="NVIDIA L4 data sheet"),
)  # fmt: skip


def chip_spec(device_kind: str) -> ChipSpec | None:
    """The `ChipSpec` of a ``jax.Device.device_kind`` (an exact name first, then the
    start of one), or None for a chip not in `CHIPS` (CPUs included).

    >>> chip_spec("TPU v5").name, chip_spec("NVIDIA H100 80GB HBM3").name
    ('TPU v5p', 'NVIDIA H100')
    >>> chip_spec("cpu") is None
    True
    """
    for chip in CHIPS:
        if device_kind in chip.device_kinds:
            return chip
    for chip in CHIPS:
        if any(device_kind.startswith(kind) for kind in chip.device_kinds):
            return chip
    return None


# ---------------------------------------------------------------- accelerator names


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """A Cloud TPU slice as libtpu's compiler names it.

    Attributes:
      name: the gcloud accelerator type asked for, e.g. ``"v5p-128"``.
      topology: libtpu's topology name, e.g. ``"v5:4x4x4"``.
      chip_config: ``"megacore"`` (v4, v5p: a chip's two TensorCores as one device)
        or ``"default"``.
      chips_per_host_bounds: the chips of one host along each axis.
      wrap: which axes of the slice close into a torus.
      chips: chips in one slice.
      chip: the chip's `ChipSpec`.
    """

    name: str
    topology: str
    chip_config: str
    chips_per_host_bounds: tuple[int, int, int]
    wrap: tuple[bool, bool, bool]
    chips: int
    chip: ChipSpec

    @property
    def devices_per_slice(self) -> int:
        """JAX devices in one slice."""
        return self.chips * self.chip.devices_per_chip


@dataclasses.dataclass(frozen=True)
class _Family:
    prefix: str  # libtpu's topology prefix
    chip: str  # the ChipSpec's name
    cores_per_chip: int  # what the accelerator name counts per chip
    config: str  # libtpu's chip_config_name
    max_chips: int  # a pod's chips


# gcloud's accelerator families. v4, v5p and TPU7x names count TensorCores (v5p-128 is 64
# chips), v5e and v6e names count chips. Shapes as MaxText maps them for its AOT compile
# (AI-Hypercomputer/maxtext, src/MaxText/accelerator_to_spec_map.py), derived here by rule.
_FAMILIES = {
    "v4": _Family("v4", "TPU v4", 2, "megacore", 4096),
    "v5p": _Family("v5", "TPU v5p", 2, "megacore", 8960),
    "v5e": _Family("v5e", "TPU v5e", 1, "default", 256),
    "v5litepod": _Family("v5e", "TPU v5e", 1, "default", 256),
    "v6e": _Family("v6e", "TPU v6e", 1, "default", 256),
    "tpu7x": _Family("tpu7x", "TPU7x", 2, "default", 9216),
}
# 3-D slices below one 4x4x4 cube: a host's 2x2x1 chips, stacked.
_SMALL_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}
KNOWN_NAMES = (
    "v4-N and v5p-N (N TensorCores, 2 per chip: 8, 16, 32, 64, then multiples of 128), "
    "v5e-N or v5litepod-N and v6e-N (N chips: 1, 4, 8, 16, 32, 64, 128, 256), "
    "tpu7x-N (N TensorCores: 2, 8, 16, 32, 64, then multiples of 128)"
)


def accelerator(name: str) -> Accelerator:
    """The slice a gcloud accelerator type names.

    Args:
      name: e.g. ``"v4-32"``, ``"v5p-128"``, ``"v5e-16"`` (or ``"v5litepod-16"``),
        ``"v6e-64"``, ``"tpu7x-8"``.

    Returns:
      Its `Accelerator`: libtpu's topology, chip configuration and host layout.

    Raises:
      TopologyError: a name that is not one of these, listing the ones there are.

    >>> a = accelerator("v6e-256")
    >>> a.topology, a.chips_per_host_bounds, a.wrap
    ('v6e:16x16', (2, 2, 1), (True, True, False))
    """
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", str(name).strip().lower())
    family = _FAMILIES.get(match.group(1)) if match else None
    count = int(match.group(2)) if match else 0
    chips = count // family.cores_per_chip if family else 0
    shape = None
    if family and count % family.cores_per_chip == 0 and 0 < chips <= family.max_chips:
        shape = _shape_2d(chips) if family.prefix in ("v5e", "v6e") else _shape_3d(family, chips)
    if shape is None:
        raise TopologyError(f"unknown accelerator type {name!r}; the known ones: {KNOWN_NAMES}")
    dims, wrap = shape
    bounds = (1, 1, 1) if chips == 1 else (2, 2, 1)
    chip = next(c for c in CHIPS if c.name == family.chip)
    topology = f"{family.prefix}:{'x'.join(map(str, dims))}"
    return Accelerator(
        str(name).strip().lower(), topology, family.config, bounds, wrap, chips, chip
    )


def _shape_2d(chips: int) -> tuple[tuple[int, ...], tuple[bool, bool, bool]] | None:
    """v5e and v6e: 1x1, then square or 1:2 power-of-two grids; a side of 16 is a ring."""
    if chips != 1 and (chips < 4 or chips & (chips - 1)):
        return None
    x = 1 if chips == 1 else 2 ** ((chips.bit_length() - 1) // 2)
    y = chips // x
    return (x, y), (x == 16, y == 16, False)


def _shape_3d(family: _Family, chips: int) -> tuple[tuple[int, ...], tuple[bool, ...]] | None:
    """v4, v5p, TPU7x: a host's 2x2x1 stacked up to 2x4x4; beyond, whole 4x4x4 cubes
    in the most cubic box (a torus on every axis)."""
    if chips == 1 and family.prefix == "tpu7x":
        return (1, 1, 1), (False, False, False)
    if chips in _SMALL_3D:
        return _SMALL_3D[chips], (False, False, False)
    if chips % 64:
        return None
    cubes = chips // 64
    box = min(
        ((a, b, cubes // (a * b)) for a in range(1, cubes + 1) for b in range(a, cubes + 1)
         if cubes % (a * b) == 0 and cubes // (a * b) >= b),
        key=lambda abc: (abc[2], abc[1]),
    )  # fmt: skip
    return tuple(4 * side for side in box), (True, True, True)


# ---------------------------------------------------------------- devices


def devices(name: str | Accelerator, slices: int = 1) -> list[jax.Device]:
    """The devices of ``slices`` slices of a Cloud TPU type, to compile for, not to run on.

    A `Replicator` over them lays out its mesh as on the real pod (``dcn_mesh`` across
    the slices); its steps lower and compile with the TPU compiler from abstract
    inputs (`jax.ShapeDtypeStruct` with shardings), and nothing executes. Needs libtpu
    (``pip install -e '.[tpu]'``), not a TPU.

    Args:
      name: a gcloud accelerator type (`accelerator`), e.g. ``"v5p-128"``.
      slices: how many such slices (multislice: each device has a ``slice_index``).

    Returns:
      ``slices * devices_per_slice`` devices whose ``device_kind`` is the chip's.

    Raises:
      TopologyError: an unknown accelerator name, ``slices < 1``, or no libtpu here.

    Example::

      repl = rp.Replicator(devices=rp.topology.devices("v5e-16", slices=2),
                           mesh={"fsdp": -1}, dcn_mesh={"data": 2})
      step = repl.compile(train_step).lower(abstract_state, abstract_batch).compile()
      step.memory_analysis()
    """
    spec = name if isinstance(name, Accelerator) else accelerator(name)
    if not isinstance(slices, int) or slices < 1:
        raise TopologyError(f"slices={slices!r}: give 1 or more slices of {spec.name}")
    check_libtpu()
    from jax.experimental import topologies

    with _quiet_libtpu(spec.name):
        try:
            description = topologies.get_topology_desc(
                platform="tpu",
                topology_name=spec.topology,
                chip_config_name=spec.chip_config,
                chips_per_host_bounds=spec.chips_per_host_bounds,
                num_slices=slices,
                wrap=spec.wrap,
            )
        except jax.errors.JaxRuntimeError as e:  # e.g. a libtpu older than the chip
            raise TopologyError(f"libtpu cannot lay out {spec.name} ({spec.topology}): {e}") from e
    return list(description.devices)


def check_libtpu() -> None:
    """Raises `TopologyError` unless libtpu, the TPU compiler, is installed here."""
    if importlib.util.find_spec("libtpu") is None:
        raise TopologyError(
            "compiling for a Cloud TPU topology needs libtpu, which is not installed here: "
            "pip install -e '.[tpu]' (jax[tpu] at this jax's version)"
        )


@contextlib.contextmanager
def _quiet_libtpu(accelerator_type: str) -> Iterator[None]:
    """Variables libtpu reads when it starts, set (where unset) while it does: off a TPU
    VM it otherwise warns that it cannot tell the accelerator type and the workers'
    hostnames, and it allows one libtpu process per machine unless told that this one
    only compiles (no TPU chips here)."""
    wanted = {"TPU_ACCELERATOR_TYPE": accelerator_type, "TPU_WORKER_HOSTNAMES": "localhost"}
    if not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"):
        wanted["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    added = [key for key in wanted if key not in os.environ]
    os.environ.update({key: wanted[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def slice_count(devices: list[jax.Device]) -> int:
    """Into how many slices ``devices`` fall (1 for devices without a ``slice_index``).

    >>> slice_count(jax.devices())
    1
    """
    return len({getattr(d, "slice_index", 0) for d in devices}) or 1
