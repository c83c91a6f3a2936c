"""Checkpoints on Orbax: the train state, the data iterator's position and the config.

Layout of ``WORKDIR/checkpoints/<step>/`` (plain Orbax, readable without
replicator):

* ``state/``  the `TrainState` pytree (``step``, ``params``, ``opt_state``,
  ``rng``) written by Orbax's PyTreeCheckpointHandler;
* ``data/``   JSON: the input iterator's state, to continue with the next batch;
* ``config/`` JSON: the resolved experiment config.

Restores always go through an abstract target carrying the *current* mesh's
shardings, never the saved ones, so a checkpoint written on 8 devices restores
on 1 or 3.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

PyTree = Any


class Checkpoints:
    """Saves and restores a run's checkpoints through one Orbax `CheckpointManager`.

    Args:
      directory: where the step directories live (``WORKDIR/checkpoints``).
      max_to_keep: how many of the latest checkpoints to keep.
      async_save: write in a background thread; the next save (or `close`)
        waits for the previous one and raises its error if it failed.
      read_only: open for restoring only (e.g. for ``eval``).
    """

    def __init__(
        self,
        directory: str,
        *,
        max_to_keep: int = 3,
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "data", "config")
        )

    def latest_step(self) -> int | None:
        """The newest finalized checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: PyTree, *, data_state: dict, config_json: str) -> None:
        """Starts saving ``state`` at ``step`` (asynchronously unless disabled)."""
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state),
                data=ocp.args.JsonSave(data_state),
                config=ocp.args.JsonSave({"json": config_json}),
            ),
            force=True,
        )

    def restore(self, step: int, abstract_state: PyTree) -> tuple[PyTree, dict]:
        """Restores the train state onto ``abstract_state``'s shardings and the data state.

        Args:
          step: which checkpoint.
          abstract_state: `jax.ShapeDtypeStruct`s with the current mesh's shardings
            (e.g. from `abstract_like`).

        Returns:
          ``(state, data_state)``.
        """
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    abstract_state, restore_args=_restore_args(abstract_state)
                ),
                data=ocp.args.JsonRestore(),
            ),
        )
        return restored["state"], restored["data"]

    def restore_params(self, step: int, abstract_params: PyTree) -> PyTree:
        """Restores only ``state.params``; the optimizer state is never read."""
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    {"params": abstract_params},
                    restore_args=_restore_args({"params": abstract_params}),
                    partial_restore=True,
                )
            ),
        )
        return restored["state"]["params"]

    def saved_config(self, step: int) -> str:
        return self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))[
            "config"
        ]["json"]

    def wait(self) -> None:
        """Blocks until an in-progress save is finalized."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _restore_args(abstract: PyTree) -> PyTree:
    return ocp.checkpoint_utils.construct_restore_args(abstract)


def abstract_like(tree: PyTree, sharding: jax.sharding.Sharding) -> PyTree:
    """`jax.ShapeDtypeStruct`s of ``tree``'s leaves, all placed with ``sharding``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
