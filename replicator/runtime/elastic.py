"""Means over the processes still alive, through JAX's own coordination service.

For DiLoCo's elastic mode (`replicator.diloco.ElasticIslands`): each process
is an island that trains on its own devices, and every sync is a mean of the
islands' outer gradients over the processes that are alive at that moment. No
transport of our own: JAX's distributed runtime started with recoverability
(``jax_enable_recoverability``; `replicator.runtime.processes.initialize` with
``recoverable=True``) keeps the survivors running when a process dies, its
heartbeat tells who is alive (``get_live_nodes``) and its key-value store
carries the bytes.

A round of `LiveGroup.mean`: read the live members; publish this process's
array under a key naming the round and that member set; read every member's
under the same set. When a member's key does not come (it died, or the others
have not noticed yet), read the members again; once the runtime has declared
one dead it can no longer publish, so a survivor that sees every key of the set
it started with finishes the round with it, and otherwise retries the round
among the survivors. Every survivor sums the same arrays in the same order: the
mean is bitwise the same everywhere. Every wait is bounded: past ``timeout_s``
the round fails with `SyncTimeout`, naming the processes that did not deliver.

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
      poll_s: how long one wait for a key lasts before the members are read again.
      prefix: the key-value namespace (one per group).
    """

    def __init__(self, timeout_s: float = 120.0, poll_s: float = 1.0, prefix: str = "live_mean"):
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
        self.timeout_s, self.poll_s, self.prefix = timeout_s, poll_s, prefix
        self.rounds = 0

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

        Raises:
          SyncTimeout: the round could not complete within ``timeout_s``.
        """
        payload = np.ascontiguousarray(array, np.float32)
        deadline = time.monotonic() + self.timeout_s
        self._client.key_value_set(f"{self.prefix}/{self.rounds}/arrived/{self.process}", "1")
        try:
            members = self.live(deadline)
        except SyncTimeout:
            late = [
                p for p in self.members
                if self._try(f"{self.prefix}/{self.rounds}/arrived/{p}") is None
            ]  # fmt: skip
            raise SyncTimeout(
                f"Sync round {self.rounds} of process {self.process} did not start in "
                f"{self.timeout_s:.0f} s: processes {late} never reached it (alive but "
                "stuck, or slower than the timeout).",
                late,
            ) from None
        while True:
            tag = f"{self.prefix}/{self.rounds}/{'-'.join(map(str, members))}"
            self._publish(tag, payload.tobytes())
            parts = self._collect(tag, members, payload.nbytes, deadline)
            if parts is not None:
                break
            try:
                now_live = self.live(deadline)
            except SyncTimeout as e:
                late = self._late(tag, members)
                raise SyncTimeout(
                    f"Sync round {self.rounds} of process {self.process} did not complete "
                    f"in {self.timeout_s:.0f} s: processes {late} did not deliver. {e}",
                    late,
                ) from None
            # Declared dead: it cannot publish any more. Finish with the set it
            # started if every key is there after all; otherwise retry among the living.
            parts = self._collect(tag, members, payload.nbytes, None)
            if parts is not None:
                break
            missing = [p for p in members if p not in now_live]
            if time.monotonic() > deadline:
                raise SyncTimeout(
                    f"Sync round {self.rounds} of process {self.process} did not complete "
                    f"in {self.timeout_s:.0f} s: processes {self._late(tag, members)} did "
                    f"not deliver (alive: {list(now_live)}).",
                    self._late(tag, members),
                )
            if missing:
                members = tuple(p for p in members if p in now_live)
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

    def _publish(self, tag: str, data: bytes) -> None:
        chunks = [data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            try:
                self._client.key_value_set_bytes(f"{tag}/{self.process}/{i}", chunk)
            except Exception as e:  # noqa: BLE001  (published by the first attempt)
                if "ALREADY_EXISTS" not in str(e):
                    raise

    def _collect(self, tag, members, nbytes: int, deadline: float | None) -> list | None:
        """Every member's bytes under ``tag``; None when one does not come in time
        (``deadline`` None: only what is there now)."""
        chunks = max(1, -(-nbytes // _CHUNK))
        parts = []
        for p in members:
            data = b""
            for i in range(chunks):
                key = f"{tag}/{p}/{i}"
                if deadline is None:
                    chunk = self._try(key, as_bytes=True)
                else:
                    wait = min(self.poll_s, max(deadline - time.monotonic(), 0.01))
                    chunk = self._get(key, wait)
                if chunk is None:
                    return None
                data += chunk
            parts.append(data)
        return parts

    def _late(self, tag: str, members) -> list[int]:
        return [p for p in members if self._try(f"{tag}/{p}/0", as_bytes=True) is None]

    def _get(self, key: str, wait_s: float) -> bytes | None:
        try:
            return self._client.blocking_key_value_get_bytes(key, max(int(wait_s * 1000), 1))
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
