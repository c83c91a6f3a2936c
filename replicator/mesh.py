"""Device discovery and mesh building.

Every Replicator owns one `jax.sharding.Mesh` with the named axes
``("data", "fsdp", "tensor")``, always all three, so that shardings are written
the same way whatever the parallelism: an axis that is not used has size 1.
The data-parallel replicas span ``data`` x ``fsdp``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "fsdp", "tensor")
# The axes a batch is split over; their product is the number of replicas.
DATA_AXES = ("data", "fsdp")


def resolve_axis_sizes(axes: Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """Returns the size of every mesh axis, with the one ``-1`` filled in.

    Args:
      axes: axis name -> size, for names in ``MESH_AXES``; missing axes get size 1
        and at most one axis may be ``-1`` ("all the devices left"). ``None`` means
        ``{"data": -1}``: pure data parallelism.
      num_devices: how many devices the mesh must cover.

    Returns:
      A dict with a size for each name in ``MESH_AXES``, in that order.

    >>> resolve_axis_sizes({"data": -1, "tensor": 2}, 8)
    {'data': 4, 'fsdp': 1, 'tensor': 2}
    """
    axes = dict({"data": -1} if axes is None else axes)
    unknown = sorted(set(axes) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"Unknown mesh axes {unknown}; the mesh axes are {list(MESH_AXES)}.")
    for name, size in axes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(f"Mesh axis {name!r} has size {size!r}; use a positive int or -1.")
    free = [name for name, size in axes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"Only one mesh axis may be -1, got {free} in {axes}.")
    fixed = math.prod(size for size in axes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"Mesh {axes}: the fixed axes multiply to {fixed}, which does not divide "
                f"the {num_devices} devices, so {free[0]!r} cannot be filled. Choose sizes "
                f"whose product divides {num_devices}."
            )
        axes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"Mesh {axes} has {fixed} devices but {num_devices} are available; make the "
            f"sizes multiply to {num_devices}, or set one axis to -1."
        )
    return {name: axes.get(name, 1) for name in MESH_AXES}


def build_mesh(
    devices: Sequence[jax.Device] | None = None,
    axes: Mapping[str, int] | None = None,
) -> Mesh:
    """Builds the ``("data", "fsdp", "tensor")`` mesh over ``devices``.

    Args:
      devices: the devices to use; ``None`` means every device of every process.
      axes: axis sizes as in `resolve_axis_sizes`.

    Returns:
      A mesh whose axes are `Auto` (the compiler propagates shardings), laid out
      for the hardware's topology when it spans all devices.
    """
    if devices is not None:
        devices = list(devices)
        if not devices:
            raise ValueError(
                "devices=[] is empty; pass at least one device, or devices=None for all "
                f"{jax.device_count()} devices."
            )
    check_joined()
    all_devices = devices is None or len(devices) == jax.device_count()
    devices = jax.devices() if devices is None else devices
    sizes = resolve_axis_sizes(axes, len(devices))
    shape = tuple(sizes.values())
    if all_devices:
        # Topology-aware order on TPU/GPU (rings along the fastest axes).
        device_array = _create_device_mesh(shape, devices)
    else:
        device_array = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _create_device_mesh(shape: tuple[int, ...], devices: list[jax.Device]) -> np.ndarray:
    from jax.experimental import mesh_utils

    try:
        return mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
        # Topologies mesh_utils does not know (e.g. fake CPU devices split oddly).
        return np.asarray(devices, dtype=object).reshape(shape)


# ---------------------------------------------------------------- multi-process

ENV_COORDINATOR = "REPLICATOR_COORDINATOR"
ENV_NUM_PROCESSES = "REPLICATOR_NUM_PROCESSES"
ENV_PROCESS_ID = "REPLICATOR_PROCESS_ID"

_joined: ProcessGroup | None = None  # what `initialize` joined


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Where this process sits in a multi-process run.

    Attributes:
      coordinator_address: ``host:port`` of process 0's coordination service.
      num_processes: how many processes take part.
      process_id: this process, in ``[0, num_processes)``.
      source: what it was detected from (``"explicit"``, ``"environment"``, or
        JAX's cluster detectors: ``"SlurmCluster"``, ``"GceTpuCluster"``, ...).
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    source: str


def detect_process_group(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ProcessGroup | None:
    """Finds out whether this is one process of several, and which.

    In order: explicit arguments; ``REPLICATOR_COORDINATOR``,
    ``REPLICATOR_NUM_PROCESSES`` and ``REPLICATOR_PROCESS_ID`` (set by
    ``python -m replicator launch``); then JAX's own cluster detectors (SLURM,
    Cloud TPU VMs, Kubernetes, Open MPI). Returns None for a single process.
    """
    environ = os.environ if environ is None else environ
    source = "explicit"
    if coordinator_address is None and ENV_COORDINATOR in environ:
        coordinator_address = environ[ENV_COORDINATOR]
        num_processes = int(environ.get(ENV_NUM_PROCESSES, 0)) or num_processes
        process_id = int(environ[ENV_PROCESS_ID]) if ENV_PROCESS_ID in environ else process_id
        source = "environment"
    if coordinator_address is None:
        # JAX's detectors (jax._src is private, but this is exactly what
        # jax.distributed.initialize() itself runs); pinned jax version.
        from jax._src import clusters

        env = next(
            (
                e
                for e in clusters.ClusterEnv._cluster_types
                if not e.opt_in_only_method and e.is_env_present()
            ),
            None,
        )
        if env is None:
            return None
        coordinator_address, num_processes, process_id, _ = (
            clusters.ClusterEnv.auto_detect_unset_distributed_params(
                None, num_processes, process_id, None, None, None
            )
        )
        source = env.__name__
    if not num_processes or num_processes <= 1:
        return None
    if process_id is None or not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id={process_id} is not in [0, {num_processes}) for the run "
            f"coordinated at {coordinator_address} ({source})."
        )
    return ProcessGroup(coordinator_address, num_processes, process_id, source)


def initialize_distributed(group: ProcessGroup | None, *, timeout_s: float = 300.0) -> None:
    """Joins the multi-process run (`jax.distributed.initialize`); nothing for one process.

    Before handing over to JAX, the processes meet at a rendezvous on the
    coordinator's host (port + 1) with the same timeout, because JAX aborts the
    process on a timeout without saying who is missing. Here a missing process
    is a `TimeoutError` naming the absent process ids and what was tried. CPU
    collectives use gloo.

    Args:
      group: from `detect_process_group`; None means a single process.
      timeout_s: how long to wait for every process to arrive.
    """
    if group is None:
        return
    from replicator import rendezvous

    rendezvous.meet(group, timeout_s=timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    host, port = split_address(group.coordinator_address)
    jax.distributed.initialize(
        coordinator_address=group.coordinator_address,
        num_processes=group.num_processes,
        process_id=group.process_id,
        initialization_timeout=max(int(timeout_s), 1),
        coordinator_bind_address=_bind_address(host, port),
    )


def initialize(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    timeout_s: float = 300.0,
) -> ProcessGroup | None:
    """Joins the process group this process was started in; call it first.

    A custom script run as several processes (by ``python -m replicator launch
    local``, ``srun`` under SLURM, or on every worker of a Cloud TPU pod) calls
    this once, before anything starts JAX's backends: before ``jax.devices()``,
    the first array or computation, or ``rp.Replicator()``. Afterwards
    ``jax.devices()`` and ``rp.Replicator()`` span the devices of every process.
    The group is found as in `detect_process_group`; the processes meet at a roll
    call and then start ``jax.distributed`` (gloo collectives on CPU; a loopback
    coordinator listens on loopback only). For a single process this does
    nothing; a second call returns the group joined by the first.

    Args:
      coordinator_address: ``host:port`` of process 0; with ``num_processes``
        and ``process_id``, overrides what the environment says.
      num_processes: how many processes take part.
      process_id: this process, in ``[0, num_processes)``.
      timeout_s: how long to wait for every process to arrive.

    Returns:
      The `ProcessGroup` joined, or None for a single process.

    Raises:
      RuntimeError: JAX's backends were started before this call in a
        multi-process run (a process can no longer join then).
      TimeoutError: a process did not arrive within ``timeout_s``; names it.
      ValueError: a second call names a different group than the first.

    Example::

      import replicator as rp

      rp.initialize()          # first: before jax.devices() or rp.Replicator()
      repl = rp.Replicator()   # every device of every process

    >>> rp.initialize() is None  # one process: nothing to join
    True
    """
    global _joined
    if _joined is not None:
        asked = (coordinator_address, num_processes, process_id)
        have = (_joined.coordinator_address, _joined.num_processes, _joined.process_id)
        if any(a is not None and a != h for a, h in zip(asked, have)):
            raise ValueError(
                f"This process already joined {_joined}; initialize() was called again with "
                f"coordinator_address={coordinator_address}, num_processes={num_processes}, "
                f"process_id={process_id}. A process joins one group, once."
            )
        return _joined
    group = detect_process_group(coordinator_address, num_processes, process_id)
    if group is None:
        return None
    if not jax.distributed.is_initialized():  # else joined already (e.g. by the CLI)
        if _backends_are_initialized():
            raise RuntimeError(
                f"rp.initialize() must run before anything starts JAX's backends, but they "
                "are running already (jax.devices(), an array, a computation or "
                f"rp.Replicator() came first), so process {group.process_id} of "
                f"{group.num_processes} ({group.source}) can no longer join. Call "
                "rp.initialize() at the top of the script, right after the imports."
            )
        initialize_distributed(group, timeout_s=timeout_s)
    _joined = group
    return group


def _backends_are_initialized() -> bool:
    # No public API says this; it is the check jax.distributed.initialize itself
    # makes (private, pinned jax version), made here before the roll call.
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def check_joined(environ: Mapping[str, str] | None = None) -> None:
    """Raises if ``launch`` started this process as one of several and it never joined.

    Without `initialize` every process would train alone on the whole batch, and
    nothing else would fail.
    """
    environ = os.environ if environ is None else environ
    if ENV_COORDINATOR not in environ or int(environ.get(ENV_NUM_PROCESSES, 1)) <= 1:
        return
    if jax.process_count() == 1:
        raise RuntimeError(
            "`python -m replicator launch` started this process as process "
            f"{environ.get(ENV_PROCESS_ID)} of {environ[ENV_NUM_PROCESSES]}, but it has "
            "not joined the others, so it would train alone. Call rp.initialize() at the "
            "top of the script, before anything uses JAX."
        )


def _bind_address(host: str, port: int) -> str | None:
    """A loopback coordinator (local runs) listens on loopback only, not on every
    interface as JAX's coordination service does by default; None keeps JAX's
    choice (its default, or ``$JAX_COORDINATOR_BIND_ADDRESS``)."""
    if not is_loopback(host) or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 hosts in brackets) as ``(host, port)``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback (then servers bind to it alone)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
