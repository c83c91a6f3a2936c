"""The trainer: ``python -m replicator train|eval`` on top of the SPMD library.

A config names an experiment (a module with ``make_experiment``, see
`Experiment`); the driver (`train_and_evaluate`) runs it with the library's
Replicator, checkpoints and writers. Nothing in ``replicator/`` imports
``experiments/``: the config's dotted path is the only link.
"""

from replicator.trainer.config import ConfigError as ConfigError
from replicator.trainer.driver import train_and_evaluate as train_and_evaluate
from replicator.trainer.evaluator import evaluate as evaluate
from replicator.trainer.evaluator import follow as follow
from replicator.trainer.experiment import ConfigKeys as ConfigKeys
from replicator.trainer.experiment import Experiment as Experiment
from replicator.trainer.experiment import Settings as Settings
