"""Checkpoints on Orbax: save asynchronously, resume exactly, restore onto any devices.

Layout of ``WORKDIR/checkpoints/<step>/`` (plain Orbax, readable without
replicator; see docs/checkpoints.md):

* ``state/``   the `TrainState` pytree (``step``, ``params``, ``opt_state``,
  ``rng``), written by Orbax's PyTreeCheckpointHandler;
* ``data/``    JSON: the input iterator's position, to continue with the next batch;
* ``config/``  JSON: the resolved experiment config;
* ``metrics/`` JSON: the eval metrics of that step, when there are any (Orbax's
  own item, read by the best-N retention).

Orbax writes each step into a temporary directory and renames it when complete,
so a checkpoint torn by a crash is never listed. Restores always go through an
abstract target carrying the *current* mesh's shardings, never the saved ones,
so a checkpoint written on 8 devices restores on 1 or 3.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers
from orbax.checkpoint._src.metadata import array_metadata_store

PyTree = Any
log = logging.getLogger("replicator")


class CheckpointMismatchError(ValueError):
    """A checkpoint's parameters do not fit the model being restored."""


class CorruptCheckpointError(RuntimeError):
    """A finalized checkpoint cannot be read (files truncated or missing)."""


class Checkpoints:
    """A run's checkpoints, through one Orbax `CheckpointManager`.

    Args:
      directory: where the step directories live (``WORKDIR/checkpoints``).
      max_to_keep: how many of the latest checkpoints to keep.
      keep_best: additionally keep this many checkpoints with the best
        ``best_metric`` (from the metrics passed to `save`, or written later by a
        sidecar evaluator with `write_metrics`); 0 disables it.
      best_metric: the metric that ranks checkpoints, e.g. ``"accuracy"``.
      best_mode: ``"max"`` or ``"min"``.
      async_save: write in a background thread. A failed background save is
        raised by the next `save` or `check_for_errors` call, never lost.
      read_only: open for restoring only (``eval``).
    """

    def __init__(
        self,
        directory: str,
        *,
        max_to_keep: int = 3,
        keep_best: int = 0,
        best_metric: str = "accuracy",
        best_mode: str = "max",
        async_save: bool = True,
        read_only: bool = False,
    ):
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}.")
        self.directory = os.path.abspath(directory)
        self._keep_best = keep_best
        policies = [checkpoint_managers.LatestN(n=max_to_keep)]
        if keep_best:
            policies.append(
                checkpoint_managers.BestN(
                    get_metric_fn=lambda metrics: metrics[best_metric],
                    reverse=best_mode == "min",
                    n=keep_best,
                    keep_checkpoints_without_metrics=False,
                )
            )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.PyTreeCheckpointHandler(type_handler_registry=_type_handlers()),
                "data": ocp.JsonCheckpointHandler(),
                "config": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        """The newest finalized checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every finalized checkpoint's step, oldest first."""
        return sorted(self._manager.all_steps())

    def reload(self) -> None:
        """Re-reads the directory (new checkpoints, metrics written by a sidecar)."""
        self._manager.reload()

    def save(
        self,
        step: int,
        state: PyTree,
        *,
        data_state: dict,
        config_json: str,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Starts saving ``state`` at ``step``; raises if an earlier async save failed."""
        # Orbax would wait for the previous save anyway; finishing it first lets
        # reload() see its metrics along with any a sidecar evaluator added since.
        self._manager.wait_until_finished()
        self._manager.check_for_errors()
        if self._keep_best:
            self._manager.reload()
        items = {
            "state": ocp.args.PyTreeSave(state),
            "data": ocp.args.JsonSave(data_state),
            "config": ocp.args.JsonSave(json.loads(config_json)),
        }
        if metrics:
            # Written as Orbax's own "metrics" item, which its best-N policy reads
            # (Orbax itself writes it only when the legacy best_fn option is set).
            items["metrics"] = ocp.args.JsonSave(metrics)
        self._manager.save(step, args=ocp.args.Composite(**items), metrics=metrics, force=True)

    def check_for_errors(self) -> None:
        """Raises the error of a failed background save, if any."""
        self._manager.check_for_errors()

    def restore(self, step: int, abstract_state: PyTree) -> tuple[PyTree, dict]:
        """Restores the train state onto ``abstract_state``'s shardings, and the data state.

        Args:
          step: which checkpoint.
          abstract_state: `jax.ShapeDtypeStruct`s with the current mesh's shardings
            (e.g. from `abstract_like`).

        Returns:
          ``(state, data_state)``.

        Raises:
          CheckpointMismatchError: the saved state has other parameters or shapes.
          CorruptCheckpointError: the checkpoint's files cannot be read.
        """
        self._check_structure(step, abstract_state)
        restored = self._read(
            step,
            state=ocp.args.PyTreeRestore(
                abstract_state, restore_args=_restore_args(abstract_state)
            ),
            data=ocp.args.JsonRestore(),
        )
        return restored["state"], restored["data"]

    def restore_params(self, step: int, abstract_params: PyTree) -> PyTree:
        """Restores only ``state.params``; the optimizer state is never read."""
        target = {"params": abstract_params}
        self._check_structure(step, target, partial=True)
        restored = self._read(
            step,
            state=ocp.args.PyTreeRestore(
                target, restore_args=_restore_args(target), partial_restore=True
            ),
        )
        return restored["state"]["params"]

    def restore_latest_good(
        self, restore_fn, *, strict: bool = False
    ) -> tuple[int, Any] | tuple[None, None]:
        """Calls ``restore_fn(step)`` on the newest checkpoint that can be read.

        A checkpoint whose files are truncated or missing is reported with its step
        and the error (which names the file), and the previous one is tried.

        Args:
          restore_fn: e.g. ``lambda step: checkpoints.restore(step, target)``.
          strict: fail on the first unreadable checkpoint instead of falling back.

        Returns:
          ``(step, restore_fn(step))``, or ``(None, None)`` if there is no checkpoint.
        """
        for step in reversed(self.all_steps()):
            try:
                return step, restore_fn(step)
            except CorruptCheckpointError as e:
                if strict:
                    raise
                log.warning("%s; falling back to the previous checkpoint.", e)
        return None, None

    def saved_config(self, step: int) -> dict:
        """The config saved with ``step``."""
        return self._read(step, config=ocp.args.JsonRestore())["config"]

    def write_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Attaches eval metrics to an existing checkpoint (a sidecar evaluator's results).

        The training process's best-N retention reads them at its next save.
        """
        path = os.path.join(self.directory, str(step), "metrics")
        os.makedirs(path, exist_ok=True)
        tmp = os.path.join(path, ".metrics.tmp")
        with open(tmp, "w") as f:
            json.dump(metrics, f)
        os.replace(tmp, os.path.join(path, "metrics"))

    def wait(self) -> None:
        """Blocks until an in-progress save is finalized; raises its error if it failed."""
        self._manager.wait_until_finished()
        self._manager.check_for_errors()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def _read(self, step: int, **items) -> Any:
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except (CheckpointMismatchError, KeyboardInterrupt):
            raise
        except Exception as e:
            raise CorruptCheckpointError(
                f"Checkpoint at step {step} in {self.directory} is unreadable: "
                f"{type(e).__name__}: {_first_line(e)}"
            ) from e

    def _check_structure(self, step: int, target: PyTree, *, partial: bool = False) -> None:
        try:
            saved = self._manager.item_metadata(step)["state"]
        except Exception as e:
            raise CorruptCheckpointError(
                f"Checkpoint at step {step} in {self.directory} has unreadable metadata: "
                f"{type(e).__name__}: {_first_line(e)}"
            ) from e
        if saved is None:
            raise CorruptCheckpointError(
                f"Checkpoint at step {step} in {self.directory} has no state/ item."
            )
        problems = _mismatches(_shapes(saved), _shapes(target), partial=partial)
        if problems:
            shown = "\n  ".join(problems[:10])
            more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
            raise CheckpointMismatchError(
                f"Checkpoint at step {step} in {self.directory} does not fit this model "
                f"(saved vs expected):\n  {shown}{more}"
            )


def _shapes(tree: PyTree) -> dict[str, tuple]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p, simple=True, separator="/"): _stored_shape(x) for p, x in flat}


def _stored_shape(x: Any) -> tuple:
    # Typed PRNG keys are stored as their key data (e.g. shape () -> (2,)).
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return tuple(jax.eval_shape(jax.random.key_data, x).shape)
    return tuple(x.shape)


def _mismatches(saved: dict[str, tuple], expected: dict[str, tuple], *, partial: bool) -> list[str]:
    problems = []
    for path, shape in expected.items():
        if path not in saved:
            problems.append(f"{path}: missing from the checkpoint, expected shape {shape}")
        elif saved[path] != shape:
            problems.append(f"{path}: saved shape {saved[path]}, expected {shape}")
    if not partial:
        for path in saved.keys() - expected.keys():
            problems.append(f"{path}: in the checkpoint (shape {saved[path]}) but not in the model")
    return sorted(problems)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:500] if text else repr(error)


def _restore_args(abstract: PyTree) -> PyTree:
    return ocp.checkpoint_utils.construct_restore_args(abstract)


def abstract_like(tree: PyTree, sharding: jax.sharding.Sharding) -> PyTree:
    """`jax.ShapeDtypeStruct`s of ``tree``'s leaves, all placed with ``sharding``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def config_differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Lists the keys whose values differ between two config dicts.

    >>> config_differences({"a": 1, "m": {"b": 2}}, {"a": 1, "m": {"b": 3}, "c": 0})
    ['c: (absent) -> 0', 'm.b: 2 -> 3']
    """
    out = []
    for key in sorted(saved.keys() | current.keys()):
        old, new = saved.get(key, "(absent)"), current.get(key, "(absent)")
        if isinstance(old, dict) and isinstance(new, dict):
            out += config_differences(old, new, f"{prefix}{key}.")
        elif _normalize(old) != _normalize(new):
            out.append(f"{prefix}{key}: {old} -> {new}")
    return out


def _normalize(value: Any) -> Any:
    # JSON turns tuples into lists; compare them as equal.
    return json.loads(json.dumps(value, default=str)) if value != "(absent)" else value


class Preempted(Exception):
    """Training stopped early on SIGTERM/SIGINT after saving a checkpoint."""

    def __init__(self, step: int, directory: str):
        super().__init__(
            f"Preempted: saved a checkpoint at step {step} in {directory}. Run the same "
            "command again to resume from it."
        )
        self.step = step
        self.directory = directory


def _type_handlers() -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's standard type handlers; in one process, arrays saved without replica slicing.

    Orbax's "replica-parallel" saving splits a replicated array into one slice
    per replica so that several hosts can write it. In one process every
    replica is on this host, and the slicing only costs an eager slice per
    array and replica: with 8 CPU devices, 2.7 s at the first save of the
    digits CNN for a 0.4 MB state. Across processes Orbax's default stays.
    """
    handlers = [
        (t, ocp.type_handlers.get_type_handler(t)) for t in ocp.type_handlers.supported_types()
    ]
    if jax.process_count() == 1:
        array = ocp.type_handlers.ArrayHandler(
            use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()
        )
        handlers = [(t, array if t is jax.Array else h) for t, h in handlers]
    return ocp.type_handlers.create_type_handler_registry(*handlers)


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
    # JAX's coordination-service client; public API exposes no key-value store yet.
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise RuntimeError("Several JAX processes but no jax.distributed client.")
    return global_state.client
