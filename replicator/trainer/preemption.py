"""Preemption: SIGTERM/SIGINT become a checkpoint at one step agreed by every process."""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence

import jax

from replicator.runtime import compat


class Preempted(Exception):
    """Training stopped early on SIGTERM/SIGINT after saving a checkpoint."""

    def __init__(self, step: int, directory: str):
        super().__init__(
            f"Preempted: saved a checkpoint at step {step} in {directory}. Run the same "
            "command again to resume from it."
        )
        self.step = step
        self.directory = directory


class PreemptionWatcher:
    """Turns SIGTERM and SIGINT into one agreed stopping step for every process.

    A signal only sets a flag (handlers are installed in the main thread, Python's
    rule). The loop asks `stop_step` at every step boundary. With one process
    the answer is the current step. With several, the first process to see a
    signal proposes ``its step + margin`` through JAX's coordination service
    (key-value store, not an XLA collective) and every process polls it, so all
    stop after the same step; the margin exceeds how far apart the processes'
    host loops can be (they are coupled through the bounded steps in flight).
    A second SIGINT stops at once.

    Args:
      margin: steps between the proposal and the agreed stop (multi-process).
      signals: the signals to catch.
    """

    _KEY = "replicator/preemption_stop_step"

    def __init__(self, margin: int = 4, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)):
        self._event = threading.Event()
        self._margin = margin
        self._agreed: int | None = None
        self._proposed = False
        self.signal_name: str | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        del frame
        if self._event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means "now"
        self.signal_name = signal.Signals(signum).name
        self._event.set()

    def requested(self) -> bool:
        """True once this process got a signal."""
        return self._event.is_set()

    def stop_step(self, step: int) -> int | None:
        """The step after which every process stops, once known; else None."""
        if self._agreed is not None:
            return self._agreed
        if jax.process_count() == 1:
            return step if self._event.is_set() else None
        client = _coordination_client()
        if self._event.is_set() and not self._proposed:
            self._proposed = True
            try:
                client.key_value_set(self._KEY, str(step + self._margin))
            except Exception:  # another process proposed first; its step wins
                pass
        try:
            self._agreed = int(client.key_value_try_get(self._KEY))
        except Exception:  # not proposed yet
            return None
        if self._agreed < step:
            raise RuntimeError(
                f"Process {jax.process_index()} is at step {step}, past the agreed preemption "
                f"step {self._agreed}; raise PreemptionWatcher's margin."
            )
        self.signal_name = self.signal_name or "a signal to another process"
        return self._agreed

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def _coordination_client():
    # JAX's public API exposes no key-value store yet: see runtime.compat.
    client = compat.coordination_client()
    if client is None:
        raise RuntimeError("Several JAX processes but no jax.distributed client.")
    return client
