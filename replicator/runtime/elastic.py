"""Means over the processes still alive, through JAX's own coordination service.

For DiLoCo's elastic mode (`ElasticIslands`, here, also ``rp.diloco.ElasticIslands``):
each process is an island that trains on its own devices, and every sync is a
mean of the islands' outer gradients over the processes that are alive at that
moment. No
transport of our own: JAX's distributed runtime started with recoverability
(``jax_enable_recoverability``; `replicator.runtime.processes.initialize` with
``recoverable=True``) keeps the survivors running when a process dies, its
heartbeat tells who is alive (``get_live_nodes``) and its key-value store
carries the bytes.

A round of `LiveGroup.mean`: each member publishes its array under a key
naming the round and itself, then meets the others at JAX's membership barrier
(``get_live_nodes`` returns once every live member has asked, the same answer
to all). Whoever is alive then has published, so every survivor reads the same
arrays and sums them in the same order: the mean is bitwise the same
everywhere. A member that died before the barrier is left out by all alike,
once the runtime's heartbeat declares it dead. Every wait is bounded: past
``timeout_s`` the round fails with `SyncTimeout`, naming the processes that
never reached it. Each member deletes its keys two rounds later, so the
coordination service (on process 0) holds at most two rounds of arrays.

What the runtime does not survive: the loss of process 0, which hosts the
coordination service (every other process then stops, "the JAX distributed
service detected fatal errors"), and on TPU, multi-controller programs (one
computation over every process) are not fault tolerant at all; this mode runs
no computation across processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from replicator.runtime import compat

# The exit status of a process whose sync could not complete in time.
EXIT_SYNC_TIMEOUT = 75
_CHUNK = 1 << 20  # bytes per key-value entry


def combine(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The float32 mean of ``parts``, summed in the order given: the same bits on
    every process that combines the same parts in the same order."""
    total = np.zeros(np.shape(parts[0]), np.float32)
    for part in parts:
        total += np.asarray(part, np.float32)
    return total / np.float32(len(parts))


class SyncTimeout(RuntimeError):
    """A sync did not complete within its timeout; ``missing`` names the processes."""

    def __init__(self, message: str, missing: Sequence[int]):
        super().__init__(message)
        self.missing = tuple(missing)


class LiveGroup:
    """The processes of a recoverable `jax.distributed` run, as they die.

    Args:
      timeout_s: the longest a `mean` may wait, in all.
      prefix: the key-value namespace (one per group).
    """

    def __init__(self, timeout_s: float = 120.0, prefix: str = "live_mean"):
        import jax

        self._client = compat.coordination_client()
        if self._client is None:
            raise RuntimeError(
                "LiveGroup needs a multi-process run: call "
                "rp.initialize(recoverable=True) first (python -m replicator launch local "
                "starts the processes)."
            )
        self.process = jax.process_index()
        self.members: tuple[int, ...] = tuple(range(jax.process_count()))
        self.timeout_s, self.prefix = timeout_s, prefix
        self.rounds = 0
        self._published: dict[int, list[str]] = {}  # round -> this process's keys

    def live(self, deadline: float | None = None) -> tuple[int, ...]:
        """The members the runtime still sees alive (a dead one never comes back).

        JAX's ``get_live_nodes`` is a barrier: it returns once every live member
        has asked, so all of them get the same answer. A member that is alive but
        stuck would hold it forever: past ``deadline`` this raises `SyncTimeout`.
        """
        box: list = []
        asking = threading.Thread(
            target=lambda: box.append(self._client.get_live_nodes(list(self.members))),
            daemon=True,  # a stuck barrier must not keep the process from exiting
        )
        asking.start()
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        asking.join(timeout)
        if not box:
            raise SyncTimeout(
                f"Process {self.process}: the live members did not all answer within "
                f"{self.timeout_s:.0f} s (one of {list(self.members)} is alive but stuck).",
                self.members,
            )
        return tuple(sorted(int(p) for p in box[0]))

    def mean(self, array: np.ndarray) -> np.ndarray:
        """The mean of ``array`` (float32) over the live members, the same bits on each.

        Each member publishes its array, then meets the others at the membership
        barrier (`live`): whoever is alive when it returns has published, so every
        survivor reads the same arrays, and none waits on a key after it. A member
        that died before the barrier is left out by everyone alike.

        Raises:
          SyncTimeout: the round could not complete within ``timeout_s``.
        """
        payload = np.ascontiguousarray(array, np.float32)
        deadline = time.monotonic() + self.timeout_s
        round_ = self.rounds
        self._published[round_] = self._publish(self._key(round_, self.process), payload.tobytes())
        try:
            members = self.live(deadline)
        except SyncTimeout:
            late = [
                p for p in self.members
                if self._try(self._key(round_, p) + "/0", as_bytes=True) is None
            ]  # fmt: skip
            raise SyncTimeout(
                f"Sync round {round_} of process {self.process} did not complete in "
                f"{self.timeout_s:.0f} s: processes {late} never reached it (alive but "
                "stuck, or slower than the timeout).",
                late,
            ) from None
        parts = self._collect(round_, members, payload.nbytes, deadline)
        if parts is None:  # published before the barrier: only a lost connection gets here
            raise SyncTimeout(
                f"Sync round {round_} of process {self.process}: the arrays of {members} "
                "could not be read back.",
                members,
            )
        for key in self._published.pop(round_ - 2, ()):  # a slow member may still read r-1
            self._client.key_value_delete(key)
        self.members = members
        self.rounds += 1
        return combine([np.frombuffer(p, np.float32).reshape(payload.shape) for p in parts])

    def close(self) -> None:
        """Leaves in an order the runtime survives: every other process first, then
        process 0 (which serves the coordination service), each wait bounded."""
        import jax

        if self.process != 0:
            self._client.key_value_set(f"{self.prefix}/exit/{self.process}", "1")
            jax.distributed.shutdown()
            return
        # Process 0 waits until the others have said goodbye and left (a process
        # that has shut down is no longer live); each wait bounded.
        deadline = time.monotonic() + self.timeout_s
        others = [p for p in self.members if p != 0]
        try:
            while time.monotonic() < deadline:
                said = all(self._try(f"{self.prefix}/exit/{p}") is not None for p in others)
                if said and not set(self.live(deadline)) & set(others):
                    break
                time.sleep(0.1)
        except SyncTimeout:
            pass  # one is stuck: leave anyway, it stops with the service
        jax.distributed.shutdown()

    # ------------------------------------------------------------ private

    def _key(self, round_: int, process: int) -> str:
        return f"{self.prefix}/{round_}/{process}"

    def _publish(self, key: str, data: bytes) -> list[str]:
        """Stores ``data`` under ``key/0``, ``key/1``, ... (bounded entries); the keys."""
        chunks = [data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
        keys = [f"{key}/{i}" for i in range(len(chunks))]
        for k, chunk in zip(keys, chunks):
            self._client.key_value_set_bytes(k, chunk)
        return keys

    def _collect(self, round_: int, members, nbytes: int, deadline: float) -> list | None:
        """Every member's bytes of round ``round_``; None when one cannot be read in time."""
        chunks = max(1, -(-nbytes // _CHUNK))
        parts = []
        for p in members:
            data = b""
            for i in range(chunks):
                chunk = self._get(f"{self._key(round_, p)}/{i}", deadline - time.monotonic())
                if chunk is None:
                    return None
                data += chunk
            parts.append(data)
        return parts

    def _get(self, key: str, wait_s: float) -> bytes | None:
        try:
            return self._client.blocking_key_value_get_bytes(key, max(int(wait_s * 1000), 100))
        except Exception as e:  # noqa: BLE001  (the runtime's timeout is a JaxRuntimeError)
            if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e):
                return None
            raise

    def _try(self, key: str, as_bytes: bool = False):
        try:
            if as_bytes:
                return self._client.key_value_try_get_bytes(key)
            return self._client.key_value_try_get(key)
        except Exception as e:  # noqa: BLE001  (NOT_FOUND)
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise


class ElasticIslands:
    """DiLoCo across processes that may die: each process is one island.

    Each process trains on its own devices (``rp.Replicator(devices=
    jax.local_devices())``, data parallelism inside the island) with
    ``repl.wrap_optimizer(tx, sync=policy)`` where ``policy.elastic`` is set;
    every ``inner_steps`` the loop calls `sync`, which averages the islands'
    outer gradients over the processes alive at that moment (membership check,
    then one mean through JAX's coordination service: `LiveGroup`) and applies
    the outer step (`replicator.parallel.diloco.DiLoCo.outer_step`). An island that died
    is dropped at the next sync and the survivors finish the run with the same
    parameters, bitwise. A sync that cannot complete within ``timeout_s`` raises
    `SyncTimeout` naming the missing processes; exit with ``EXIT_SYNC_TIMEOUT``
    and restart from the last checkpoint. Also ``rp.diloco.ElasticIslands``.

    Start the processes with ``rp.initialize(recoverable=True,
    heartbeat_timeout_s=...)``: a process counts as dead after that long
    without a heartbeat. Process 0 must survive (it serves the coordination
    service; when it dies, every process stops).

    Args:
      policy: the `rp.DiLoCo` policy given to ``wrap_optimizer`` (``elastic=True``).
      timeout_s: the longest one sync may take (from the first island to reach it).
    """

    def __init__(self, policy: Any, *, timeout_s: float = 120.0):
        if not getattr(policy, "elastic", False):
            raise ValueError("ElasticIslands needs DiLoCo(..., elastic=True).")
        self.policy = policy
        self.group = LiveGroup(timeout_s=timeout_s, prefix="diloco")

    @property
    def members(self) -> tuple[int, ...]:
        """The processes that took part in the last sync."""
        return self.group.members

    def sync(self, tree: Any) -> Any:
        """Every DiLoCo train state in ``tree`` after a sync over the live islands."""
        return self.policy.outer_step(tree, lambda delta: self.group.mean(delta))

    def close(self) -> None:
        """Leaves the run in an order JAX's runtime survives (process 0 last)."""
        self.group.close()
