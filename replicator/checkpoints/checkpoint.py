"""Checkpoints on Orbax: save asynchronously, resume exactly, restore onto any devices.

`Checkpoints` is the one checkpoint code path: custom training loops use it
directly and the trainer (``replicator.trainer``) uses it too. Each step is a
plain Orbax step directory, ``<directory>/<step>/``, readable without
replicator (docs/guide.md, "Reading a checkpoint with Orbax alone"):

* ``state/``   the state pytree (for the trainer, `TrainState`), written by
  Orbax's PyTreeCheckpointHandler;
* ``data/``    JSON: the input iterator's position, when one was given;
* ``config/``  JSON: the resolved experiment config, when one was given;
* ``metrics/`` JSON: eval metrics of that step, when there are any (Orbax's
  own item, read by the best-N retention);
* ``before_commit/`` JSON: ``{"before_commit": ...}``, what a save's
  ``before_commit`` callable (the trainer's upload of its records) returned,
  when one was given; written after the callable ran, as a part of the save,
  so the step is never listed before it. Orbax's own JSON handler reads it.

Orbax writes each step into a temporary directory and renames it when complete,
so a checkpoint torn by a crash is never listed. A listed step that cannot be
read (a bad disk, a truncated copy) is skipped for the newest readable one and,
unless read-only, moved aside to ``<directory>.corrupt/<step>``: nothing is
deleted, and the step can be saved again. Restores always go through an
abstract target carrying the *current* Replicator's shardings, never the saved
ones, so a checkpoint written on 8 devices restores on 1 or 3.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers
from orbax.checkpoint.future import CommitFutureAwaitingContractedSignals

from replicator import storage
from replicator.checkpoints import files as checkpoint_files
from replicator.checkpoints.files import save_errors, storage_errors
from replicator.errors import CheckpointMismatchError as CheckpointMismatchError
from replicator.errors import CheckpointNotFoundError as CheckpointNotFoundError
from replicator.errors import CorruptCheckpointError as CorruptCheckpointError
from replicator.parallel.placement import Kind, PerReplica, is_per_replica, mark_like, sharding_for
from replicator.runtime import compat

if TYPE_CHECKING:
    from replicator.replicator import Replicator

PyTree = Any
log = logging.getLogger("replicator")


class Checkpoints:
    """A run's checkpoints in ``directory``: asynchronous saves, restores onto ``repl``.

    One Orbax `CheckpointManager` underneath. `save` starts writing in a
    background thread and returns; `restore` places every array on ``repl``'s
    devices, whatever devices wrote it.

    Args:
      directory: where the step directories live (the trainer uses
        ``WORKDIR/checkpoints``), local or ``gs://``; created unless ``read_only``.
      repl: the `Replicator` whose mesh restored arrays are placed on.
      keep: how many of the latest checkpoints to keep; None keeps all.
      keep_best: additionally keep this many checkpoints with the best
        ``best_metric`` (from the ``metrics`` passed to `save`, or attached later
        with `write_metrics`); 0 disables it.
      best_metric: the metric that ranks checkpoints, e.g. ``"accuracy"``.
      best_mode: ``"max"`` or ``"min"``.
      async_save: write in a background thread; False makes `save` block.
      read_only: open for restoring only (never creates, writes, moves or
        deletes).

    Example (a custom loop saves, then resumes from the newest step):

    >>> import tempfile, jax, jax.numpy as jnp
    >>> repl = rp.Replicator()
    >>> ckpt = rp.Checkpoints(tempfile.mkdtemp(), repl, keep=2)
    >>> state = repl.replicate({"w": jnp.zeros(3)})
    >>> for step in range(1, 4):
    ...     state = {"w": state["w"] + 1}
    ...     ckpt.save(step, state)                # returns at once
    >>> ckpt.wait()                               # the last save is on disk
    >>> ckpt.all_steps(), ckpt.latest_step()      # keep=2
    ([2, 3], 3)
    >>> abstract = jax.eval_shape(lambda: state)  # shapes only: no memory
    >>> ckpt.restore(like=abstract)["w"].tolist()
    [3.0, 3.0, 3.0]
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        repl: Replicator,
        *,
        keep: int | None = 3,
        keep_best: int = 0,
        best_metric: str | None = None,
        best_mode: str = "max",
        async_save: bool = True,
        read_only: bool = False,
    ):
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}.")
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (or None to keep all), got {keep}.")
        if keep_best and best_metric is None:
            raise ValueError("keep_best needs best_metric: the name of the metric that ranks.")
        self.directory = storage.normalize(directory)  # a local path or a gs:// URL
        checkpoint_files.check_directory(self.directory)  # a missing bucket: one line
        self.repl = repl
        self.read_only = read_only
        self._async = async_save
        self.restored_step: int | None = None
        self._keep_best = keep_best
        self._json: dict[int, dict[str, Any]] = {}  # step -> its JSON items, read with the state
        self._before_commit = _BeforeCommitHandler()
        policies = [checkpoint_managers.LatestN(n=keep)]
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
            save_interval_steps=0 if read_only else 1,  # Orbax warns unless it is 0
        )
        with _without_read_only_notice():
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=options,
                handler_registry=_handler_registry(self._before_commit),
            )
        self._remote = storage.is_remote(self.directory)
        if self._remote and not read_only:
            self._set_aside_unfinished()
        if async_save and not read_only:
            # A script that ends right after `save` would lose the checkpoint: at
            # exit Python refuses the thread-pool work Orbax's writer still needs.
            # Hooks registered here run before that pool shuts down (atexit's run
            # after), so the last save completes.
            compat.at_thread_shutdown(_finish_saving, weakref.ref(self._manager))

    def __repr__(self) -> str:
        return f"Checkpoints({self.directory!r}, steps {self.all_steps()})"

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def latest_step(self) -> int | None:
        """The newest finalized checkpoint's step, or None when there is none.

        Returns:
          An int, or None. It counts this process's save in flight too (`restore`
          waits for it).
        """
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
        data_state: Any = None,
        *,
        config: dict | None = None,
        metrics: dict[str, float] | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        """Starts saving ``state`` as checkpoint ``step`` and returns.

        The arrays are copied off the devices, then written in a background
        thread; the next `save`, `wait` or `close` waits for that write first
        and raises its error if it failed. Retention (``keep``, ``keep_best``)
        deletes older checkpoints once the new one is finalized. A checkpoint
        that already exists for ``step`` (say, a custom loop restarted from an
        earlier step) is moved to ``<directory>.replaced/<step>`` with a
        warning, never written over in place nor deleted.

        Args:
          step: the checkpoint's step number (its directory name).
          state: any pytree of arrays: a `TrainState`, ``(params, opt_state)``,
            per-replica values returned by `Replicator.run`, typed PRNG keys.
          data_state: JSON-serialisable position of the input pipeline (e.g.
            ``{"iterator": it.get_state().decode()}``), read back with
            `saved_data_state`; None saves none.
          config: a JSON-serialisable dict stored beside the state
            (`saved_config`).
          metrics: eval metrics of this step, ranked by ``keep_best``.
          before_commit: called in the background once `save` returned; the step
            is committed only after it returns, and fails if it raises (the
            trainer's upload of its records: never a checkpoint without them).

        Raises:
          Exception: the error of an earlier background save that failed.

        Example::

          ckpt.save(step, state, data_state={"epoch": 3})
        """
        # Orbax would wait for the previous save anyway; finishing it first lets
        # reload() see its metrics along with any a sidecar evaluator added since.
        self.wait()
        if self._keep_best:
            self._manager.reload()
        listed = step in self._manager.all_steps()
        if listed or (not self._remote and self._step_path(step).exists()):
            moved = self._move_aside(step, "replaced")
            log.warning("Checkpoint step %d already existed; moved it to %s.", step, moved)
        self._json.pop(step, None)
        returned = threading.Event()  # before_commit starts once the caller has its thread back
        if not self._async:
            returned.set()  # a synchronous save runs it before it returns
        items = _save_items(state, data_state, config, metrics)
        if before_commit is not None:
            self._before_commit.pending = (before_commit, returned)
            items["before_commit"] = ocp.args.JsonSave({})  # written by the handler
        try:
            with save_errors(f"save checkpoint {step} in", self.directory):
                self._manager.save(step, args=ocp.args.Composite(**items), metrics=metrics,
                                   force=True)  # fmt: skip
        finally:
            returned.set()

    def wait(self) -> None:
        """Blocks until the save in flight is finalized; raises its error if it failed (a
        storage failure as a `StorageError`; an outage, a `StorageUnavailableError`)."""
        with save_errors("save a checkpoint in", self.directory):
            self._manager.wait_until_finished()
            self._manager.check_for_errors()

    def check_for_errors(self) -> None:
        """Raises the error of a failed background save, if any, without waiting."""
        with save_errors("save a checkpoint in", self.directory):
            self._manager.check_for_errors()

    def close(self) -> None:
        """Waits for the save in flight, then releases the manager."""
        with save_errors("save a checkpoint in", self.directory):
            self._manager.wait_until_finished()
        self._manager.close()

    def restore(
        self,
        like: PyTree,
        step: int | None = None,
        *,
        strict: bool = False,
        partial: bool = False,
    ) -> PyTree:
        """Reads checkpoint ``step`` into the structure of ``like``, on ``repl``'s devices.

        Each leaf of ``like`` gives the shape, dtype and placement of a restored
        array: a leaf with a sharding on exactly ``repl``'s devices keeps it; a
        per-replica value (returned stacked by `Replicator.run`, or inside
        `PerReplica`) is split one row per replica (``repl.batch_sharding``) and
        round-trips into ``run``; every other leaf is mirrored on ``repl.mesh``.
        So a checkpoint written on 8 devices restores onto 1 or 3.

        Args:
          like: the state to restore into: concrete arrays, or abstract ones
            (``jax.eval_shape`` output, `jax.ShapeDtypeStruct` with or without
            a sharding). Its values are never read.
          step: which checkpoint; None means the newest readable one: an
            unreadable newer checkpoint is skipped with one warning line naming
            it and, unless ``read_only``, moved to ``<directory>.corrupt/<step>``
            (kept for inspection; the step can then be saved again). The step
            read is left in ``self.restored_step``.
          strict: with ``step=None``, fail on an unreadable checkpoint instead
            of falling back to the previous one.
          partial: ``like`` names only part of the saved state, e.g.
            ``{"params": ...}`` of a saved `TrainState` (for evaluation); the
            rest is neither read nor allocated.

        Returns:
          The restored state, structured like ``like``.

        Raises:
          FileNotFoundError: no checkpoint (or none for ``step``) in the directory.
          CheckpointMismatchError: the saved state has other paths or shapes than
            ``like``; the message lists each with both shapes.
          CorruptCheckpointError: the checkpoint's files cannot be read (with
            ``step=None``: none of them can; nothing is moved then).

        Example::

          state = ckpt.restore(like=jax.eval_shape(init_state))   # the newest step
          params = ckpt.restore(like={"params": abstract.params}, step=100, partial=True)
        """
        target = _without_marks(_restore_target(like, self.repl))

        def read(step: int) -> PyTree:
            self._check_structure(step, target, partial=partial)
            args = ocp.args.PyTreeRestore(
                target, restore_args=_restore_args(target), partial_restore=partial
            )
            state = self._read(step, state=args)["state"]
            self._read_json(step)  # a step is readable only if all of it is
            return state

        return _marked_like(self._restore_readable(step, read, strict), like)

    def saved_shapes(self, step: int) -> dict[str, tuple]:
        """Each array saved with ``step``: its path (keys joined by ``/``) -> its shape."""
        self._check_structure(step, {}, partial=True)  # unreadable metadata: one line
        return _shapes(self._manager.item_metadata(step)["state"])

    def saved_data_state(self, step: int) -> Any:
        """The ``data_state`` saved with ``step``, or None if it was saved without one."""
        return self._read_json(step).get("data")

    def saved_config(self, step: int) -> dict:
        """The ``config`` saved with ``step``."""
        items = self._read_json(step)
        if "config" not in items:
            raise CorruptCheckpointError(
                f"Checkpoint at step {step} in {self.directory} has no config/ item"
            )
        return items["config"]

    def write_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Attaches eval metrics to an existing checkpoint (a sidecar evaluator's results).

        The training process's best-N retention reads them at its next save.
        """
        storage.write_text(storage.join(self.directory, str(step), "metrics", "metrics"),
                           json.dumps(metrics))  # fmt: skip

    def _restore_readable(
        self, step: int | None, read: Callable[[int], PyTree], strict: bool
    ) -> PyTree:
        """``read(step)``, or with ``step=None`` ``read`` of the newest readable step."""
        self._manager.wait_until_finished()  # a save of this process in flight is readable
        available = self.all_steps()
        if step is not None:
            if step not in available:
                raise CheckpointNotFoundError(
                    f"No checkpoint for step {step} in {self.directory}; available steps: "
                    f"{available or 'none'}."
                )
            result = read(step)
            self.restored_step = step
            return result
        if not available:
            raise CheckpointNotFoundError(
                f"No readable checkpoint in {self.directory}; available steps: none."
            )
        unreadable = []
        for candidate in reversed(available):
            try:
                result = read(candidate)
            except CorruptCheckpointError as e:
                if strict:
                    raise
                unreadable.append((candidate, e))
                continue
            self.restored_step = candidate
            for bad, error in unreadable:
                self._set_aside_unreadable(bad, error, instead=candidate)
            return result
        # None readable: nothing is moved (a storage outage looks the same as damage,
        # and starting over would discard the run); the user decides.
        raise CorruptCheckpointError(
            f"No readable checkpoint in {self.directory}: steps {available} are all "
            f"unreadable (the newest: {unreadable[0][1]}). Move the directory aside to "
            "start over, or fix what keeps them from being read"
        )

    def _set_aside_unreadable(self, step: int, error: Exception, *, instead: int) -> None:
        """Warns, in one line, of an unreadable step and moves it out of the way (unless
        ``read_only``); ``instead`` is the step restored."""
        moved = "" if self.read_only else f"moved it to {self._move_aside(step, 'corrupt')} and "
        log.warning("%s; %srestored step %d instead.", error, moved, instead)

    def _set_aside_unfinished(self) -> None:
        """Moves the remains of saves cut short (a kill or an outage mid-save) out of the
        way (`unfinished_steps`)."""
        for step in checkpoint_files.unfinished_steps(self.directory, self._manager.all_steps()):
            moved = self._move_aside(step, "unfinished")
            log.info("An unfinished save of step %d was moved to %s.", step, moved)

    def _step_path(self, step: int) -> epath.Path:
        return storage.path(self.directory) / str(step)

    def _move_aside(self, step: int, reason: str) -> str:
        """Moves step's directory to ``<directory>.<reason>/<step>`` (a fresh name if
        taken) on process 0, and forgets it, so that the step can be saved again."""
        target = checkpoint_files.move_aside(self.directory, step, reason)
        self._json.pop(step, None)
        self._manager.reload()
        return target

    def _read_json(self, step: int) -> dict[str, Any]:
        """The JSON items (``data``, ``config``) that ``step`` has, read once."""
        if step not in self._json:
            self._manager.wait_until_finished()  # a save of this step may be in flight
            present = [n for n in ("data", "config") if (self._step_path(step) / n).is_dir()]
            items = {name: ocp.args.JsonRestore() for name in present}
            self._json[step] = dict(self._read(step, **items)) if items else {}
        return self._json[step]

    def _read(self, step: int, **items) -> Any:
        # A storage that does not answer is an outage, not damage: nothing is set aside.
        with storage_errors(f"read checkpoint {step} in", self.directory):
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
        with storage_errors(f"read checkpoint {step} in", self.directory):
            try:
                saved = self._manager.item_metadata(step)["state"]
            except Exception as e:
                raise CorruptCheckpointError(
                    f"Checkpoint at step {step} in {self.directory} has unreadable metadata: "
                    f"{type(e).__name__}: {_first_line(e)}"
                ) from e
        if saved is None:
            raise CorruptCheckpointError(
                f"Checkpoint at step {step} in {self.directory} has no state/ item"
            )
        problems = _mismatches(_shapes(saved), _shapes(target), partial=partial)
        if problems:
            raise CheckpointMismatchError(
                f"Checkpoint at step {step} in {self.directory} does not fit the state to "
                f"restore (saved vs expected):\n  {_listed(problems)}"
            )


def _handler_registry(
    before_commit: _BeforeCommitHandler,
) -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """Each item's Orbax handler (the module docstring's list), for save and restore;
    Orbax's manager adds its own for ``metrics``."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    handlers = {
        "state": ocp.PyTreeCheckpointHandler(type_handler_registry=_type_handlers()),
        "data": ocp.JsonCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
        "before_commit": before_commit,
    }
    for item, handler in handlers.items():
        is_state = item == "state"
        registry.add(item, ocp.args.PyTreeSave if is_state else ocp.args.JsonSave, handler)
        registry.add(item, ocp.args.PyTreeRestore if is_state else ocp.args.JsonRestore, handler)
    return registry


def _save_items(state, data_state, config, metrics) -> dict:
    """`Checkpoints.save`'s Orbax items (see the module docstring)."""
    items = {"state": ocp.args.PyTreeSave(_without_marks(state))}
    if data_state is not None:
        items["data"] = ocp.args.JsonSave(data_state)
    if config is not None:
        items["config"] = ocp.args.JsonSave(config)
    if metrics:
        # Written as Orbax's own "metrics" item, which its best-N policy reads
        # (Orbax itself writes it only when the legacy best_fn option is set).
        items["metrics"] = ocp.args.JsonSave(metrics)
    return items


def _restore_target(like: PyTree, repl: Replicator) -> PyTree:
    """``like`` as `jax.ShapeDtypeStruct`s with the shardings to restore onto ``repl``."""
    devices = set(repl.mesh.devices.flat)

    def place(path, x, per_replica: bool):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            return x  # Python scalars and strings come back as Orbax saved them
        if per_replica or is_per_replica(x):
            rows = x.shape[0] if x.shape else None
            if rows != repl.num_replicas:
                raise CheckpointMismatchError(
                    f"{_path_str(path)} is a per-replica value with {rows} rows, but this "
                    f"Replicator has {_replicas(repl.num_replicas)}. A per-replica value "
                    f"restores only onto as many replicas as saved it: restore it onto "
                    f"{_replicas(rows)}, or reduce it before saving."
                )
            sharding = sharding_for(Kind.PER_REPLICA, repl.mesh)
        else:
            sharding = getattr(x, "sharding", None)
            if not (isinstance(sharding, jax.sharding.Sharding) and sharding.device_set == devices):
                sharding = sharding_for(Kind.MIRRORED, repl.mesh)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    def visit(path, node):
        if isinstance(node, PerReplica):
            return PerReplica(
                jax.tree_util.tree_map_with_path(lambda p, x: place(path + p, x, True), node.values)
            )
        return place(path, node, False)

    return jax.tree_util.tree_map_with_path(
        visit, like, is_leaf=lambda x: isinstance(x, PerReplica)
    )


def _listed(lines: list[str], limit: int = 10) -> str:
    more = f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else ""
    return "\n  ".join(lines[:limit]) + more


def _replicas(n: int | None) -> str:
    """``"1 replica"``, ``"8 replicas"``."""
    return f"{n} replica{'' if n == 1 else 's'}"


def _is_marked(x: Any) -> bool:
    return isinstance(x, PerReplica)


def _without_marks(tree: PyTree) -> PyTree:
    """``tree`` with each `PerReplica` replaced by its values: the layout on disk."""
    return jax.tree.map(lambda x: x.values if _is_marked(x) else x, tree, is_leaf=_is_marked)


def _marked_like(restored: PyTree, like: PyTree) -> PyTree:
    """``restored`` (read unmarked) with ``like``'s `PerReplica` wrappers and marks."""
    marks, treedef = jax.tree.flatten(like, is_leaf=_is_marked)
    parts = treedef.flatten_up_to(restored)
    parts = [PerReplica(p) if _is_marked(m) else p for m, p in zip(marks, parts, strict=True)]
    return mark_like(treedef.unflatten(parts), like)


class _BeforeCommitHandler(ocp.JsonCheckpointHandler):
    """Orbax's JSON handler that first runs a save's ``before_commit`` callable.

    Orbax commits a step only when every item's futures are done, so the step is
    listed only after the callable returned. The item it writes is plain JSON, and
    `typestr` names Orbax's own JSON handler in the step's metadata: a generic
    ``CheckpointManager(...).restore(step)`` without replicator reads it like
    ``data`` and ``config``. The callable travels on the handler (`pending`), set
    by `Checkpoints.save` for the one save at a time that Orbax runs.
    """

    pending: tuple[Callable[[], Any], threading.Event] | None = None

    @classmethod
    def typestr(cls) -> str:
        return ocp.JsonCheckpointHandler.typestr()

    async def async_save(self, directory: epath.Path, item=None, args=None):
        fn, returned = self.pending
        self.pending = None
        write = compat.orbax_json_write(self)

        async def call() -> None:
            # Not while `save` still blocks its caller: the callable (an upload) would
            # compete with the device-to-host copy for the interpreter.
            returned.wait()
            await write({"before_commit": _returned_json(fn())}, directory)

        return [CommitFutureAwaitingContractedSignals(call(), name="before_commit")]


def _returned_json(value: Any) -> Any:
    """What a ``before_commit`` callable returned, as JSON (None if it is not)."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return None
    return value


def _finish_saving(manager_ref: weakref.ref) -> None:
    manager = manager_ref()
    if manager is not None:
        manager.wait_until_finished()


def _path_str(path) -> str:
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/") or "the state"


def _shapes(tree: PyTree) -> dict[str, tuple]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    # (Orbax's placeholder, ``...``, marks a leaf not to read.)
    return {_path_str(p): _stored_shape(x) for p, x in flat if x is not ocp.PLACEHOLDER}


def _stored_shape(x: Any) -> tuple:
    # Typed PRNG keys are stored as their key data (e.g. shape () -> (2,)).
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return tuple(jax.eval_shape(jax.random.key_data, x).shape)
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _mismatches(saved: dict[str, tuple], expected: dict[str, tuple], *, partial: bool) -> list[str]:
    problems = []
    for path, shape in expected.items():
        if path not in saved:
            problems.append(f"{path}: missing from the checkpoint, expected shape {shape}")
        elif saved[path] != shape:
            problems.append(f"{path}: saved shape {saved[path]}, expected {shape}")
    if not partial:
        for path in saved.keys() - expected.keys():
            problems.append(f"{path}: in the checkpoint (shape {saved[path]}) but not expected")
    return sorted(problems)


def _first_line(error: BaseException) -> str:
    """The error's first line without tensorstore's spec dumps (``[tensorstore_spec=...``,
    ``<bound method ... of TensorStore({...``), which say nothing to a reader.

    >>> _first_line(ValueError("DATA_LOSS: bad manifest [tensorstore_spec={...}]"))
    'DATA_LOSS: bad manifest'
    """
    text = str(error).strip()
    if not text:
        return repr(error)
    line = re.split(r"\s*(?:\[tensorstore_spec=|<bound method |\bTensorStore\(\{)",
                    text.splitlines()[0])[0]  # fmt: skip
    return line.rstrip(" :;,")[:300]


@contextlib.contextmanager
def _without_read_only_notice():
    """Drops the warning Orbax logs for every read-only manager (it is the intent)."""

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")

    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(keep)
    try:
        yield
    finally:
        absl_logger.removeFilter(keep)


def _restore_args(target: PyTree) -> PyTree:
    return ocp.checkpoint_utils.construct_restore_args(target)


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
        array = compat.array_handler_without_replica_parallel()
        handlers = [(t, array if t is jax.Array else h) for t, h in handlers]
    return ocp.type_handlers.create_type_handler_registry(*handlers)
