"""``python -m replicator params --config FILE[:MODE] [--config.KEY=VALUE ...]``: a model's
parameters, as the config's optimizer keys see them.

One row per parameter array of every `rp.TrainState` the config's experiment makes:
its path, shape, dtype and size, and what ``freeze``, ``lr_mults`` and
``weight_decay`` (with ``weight_decay_mask``) do to it under this config, so a
regex can be written against the real paths before a run starts
(`replicator.trainer.parameter_table`). The model state beside the parameters
(batch statistics) follows, under the paths ``init_from_rules`` and
``init_from_skip`` see.

Nothing is trained, compiled or written, and no workdir is needed: the state's
shapes come from ``jax.eval_shape`` of the experiment's own initialisation (the
trainer's `setup`, on the devices there are), so a model of billions of
parameters is listed in seconds. Shapes of the data come from the dataset's
metadata where it has them, else from one example read (`aot.example_shapes`).
A ``freeze`` or ``lr_mults`` that takes every parameter is a warning (`setup`'s).
"""

from __future__ import annotations

import ml_collections

from replicator.trainer import aot, pretrained
from replicator.trainer.parameter_table import report
from replicator.trainer.setup import setup


def main(config: ml_collections.ConfigDict, console) -> None:
    """Builds the config's run from shapes alone and prints its parameters.

    Args:
      config: the config, as the command line gave it (overrides applied).
      console: the command's `replicator.trainer.console.Console`.

    Raises:
      ConfigError: a mistake in the config (the trainer's own checks, `setup`'s).
    """
    config = pretrained.checkpoint_model(config)  # init_from='hf:DIR': its shape
    shaped = aot.example_shapes(config)
    run = setup(config, training=False, eval_source=None if shaped.example is None else
                [shaped.example])  # fmt: skip
    try:  # (setup warned of a freeze or lr_mults that takes every parameter)
        lines = report(run.config, run.abstract_state)
    finally:
        run.close()
    for line in lines:
        console.print(line)
