"""Process groups: which process of a multi-process run this is, and joining the others.

``python -m replicator launch`` (local processes), SLURM and Cloud TPU VMs each
describe a run of several processes in their own way; `detect_process_group`
reads whichever is there, and `initialize` joins the group: a roll call on the
coordinator's port + 1 that names absent processes (JAX's own timeout aborts
without saying who is missing), then ``jax.distributed``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax

from replicator.runtime import compat, rendezvous
from replicator.runtime.rendezvous import ProcessGroup, is_loopback, split_address

ENV_COORDINATOR = "REPLICATOR_COORDINATOR"
ENV_NUM_PROCESSES = "REPLICATOR_NUM_PROCESSES"
ENV_PROCESS_ID = "REPLICATOR_PROCESS_ID"

_joined: ProcessGroup | None = None  # what `initialize` joined


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
        detected = compat.detect_cluster(num_processes, process_id)
        if detected is None:
            return None
        source, coordinator_address, num_processes, process_id = detected
    if not num_processes or num_processes <= 1:
        return None
    if process_id is None or not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id={process_id} is not in [0, {num_processes}) for the run "
            f"coordinated at {coordinator_address} ({source})."
        )
    return ProcessGroup(coordinator_address, num_processes, process_id, source)


def initialize_distributed(
    group: ProcessGroup | None,
    *,
    timeout_s: float = 300.0,
    recoverable: bool = False,
    heartbeat_timeout_s: int = 100,
) -> None:
    """Joins the multi-process run (`jax.distributed.initialize`); nothing for one process.

    Before handing over to JAX, the processes meet at a rendezvous on the
    coordinator's host (port + 1) with the same timeout, because JAX aborts the
    process on a timeout without saying who is missing. Here a missing process
    is a `TimeoutError` naming the absent process ids and what was tried. CPU
    collectives use gloo.

    Args:
      group: from `detect_process_group`; None means a single process.
      timeout_s: how long to wait for every process to arrive.
      recoverable: the others go on when a process dies (JAX's
        ``jax_enable_recoverability``), for `replicator.runtime.elastic`.
      heartbeat_timeout_s: after how long without a heartbeat a process is dead.
    """
    if group is None:
        return
    rendezvous.meet(group, timeout_s=timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if recoverable:
        jax.config.update("jax_enable_recoverability", True)
    host, port = split_address(group.coordinator_address)
    jax.distributed.initialize(
        coordinator_address=group.coordinator_address,
        num_processes=group.num_processes,
        process_id=group.process_id,
        initialization_timeout=max(int(timeout_s), 1),
        coordinator_bind_address=_bind_address(host, port),
        heartbeat_timeout_seconds=heartbeat_timeout_s,
    )


def initialize(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    timeout_s: float = 300.0,
    recoverable: bool = False,
    heartbeat_timeout_s: int = 100,
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
      recoverable: keep going when another process dies (JAX's
        ``jax_enable_recoverability``): for DiLoCo's elastic islands
        (`replicator.runtime.elastic.ElasticIslands`), which run no computation across
        processes. Process 0 must survive: it serves the coordination service.
      heartbeat_timeout_s: after how long without a heartbeat a process counts
        as dead (JAX's default: 100).

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
        _check_same_group(_joined, coordinator_address, num_processes, process_id)
        return _joined
    group = detect_process_group(coordinator_address, num_processes, process_id)
    if group is None:
        return None
    if not jax.distributed.is_initialized():  # else joined already (e.g. by the CLI)
        if compat.backends_are_initialized():
            raise RuntimeError(
                f"rp.initialize() must run before anything starts JAX's backends, but they "
                "are running already (jax.devices(), an array, a computation or "
                f"rp.Replicator() came first), so process {group.process_id} of "
                f"{group.num_processes} ({group.source}) can no longer join. Call "
                "rp.initialize() at the top of the script, right after the imports."
            )
        initialize_distributed(
            group,
            timeout_s=timeout_s,
            recoverable=recoverable,
            heartbeat_timeout_s=heartbeat_timeout_s,
        )
    _joined = group
    return group


def _check_same_group(joined: ProcessGroup, coordinator_address, num_processes, process_id):
    """A second `initialize` may repeat the first's group, not name another."""
    asked = (coordinator_address, num_processes, process_id)
    have = (joined.coordinator_address, joined.num_processes, joined.process_id)
    if any(a is not None and a != h for a, h in zip(asked, have)):
        raise ValueError(
            f"This process already joined {joined}; initialize() was called again with "
            f"coordinator_address={coordinator_address}, num_processes={num_processes}, "
            f"process_id={process_id}. A process joins one group, once."
        )


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
