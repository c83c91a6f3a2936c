"""The user's mistakes are types (`replicator.errors`), reachable by their old names."""

import pytest

import replicator as rp
from replicator import errors, storage
from replicator.checkpoints import checkpoint as checkpoint
from replicator.parallel import sharding as sharding
from replicator.runtime import tpu
from replicator.spmd import context as context
from replicator.trainer import config, config_files
from replicator.trainer.data import sources

# Each class, where it was raised from before it lived in errors.py, and the built-in
# base that callers' except clauses rely on.
OLD_HOMES = [
    (config.ConfigError, ValueError),
    (checkpoint.CheckpointMismatchError, ValueError),
    (checkpoint.CorruptCheckpointError, RuntimeError),
    (sharding.ShardingError, ValueError),
    (context.AxisNameError, NameError),
    (storage.StorageError, OSError),
    (sources.DatasetNotPreparedError, ValueError),
    (tpu.LaunchError, Exception),
    (rp.AxisNameError, NameError),
]


@pytest.mark.parametrize("cls, base", OLD_HOMES, ids=lambda x: x.__name__)
def test_each_user_error_keeps_its_old_name_and_base(cls, base):
    assert getattr(errors, cls.__name__) is cls
    assert issubclass(cls, rp.UserError) and issubclass(cls, base)


def test_every_error_class_is_a_user_error():
    classes = [v for v in vars(errors).values() if isinstance(v, type)]
    assert classes and all(issubclass(c, errors.UserError) for c in classes)
    assert rp.UserError is errors.UserError


def test_a_config_files_own_user_error_is_reported_as_itself():
    inner = config.ConfigError("unknown config mode 'smok'")
    try:
        try:
            raise inner
        except config.ConfigError as e:
            raise ValueError(f"Error whilst parsing config file:\n\nTraceback...\n{e}") from e
    except ValueError as outer:
        assert config_files.flag_error(outer, []) is inner


def test_an_outage_is_a_storage_error_with_its_own_exit_status():
    from replicator.trainer import cli

    assert issubclass(errors.StorageUnavailableError, storage.StorageError)
    assert storage.StorageUnavailableError is errors.StorageUnavailableError
    assert (cli.USAGE_ERROR, cli.STORAGE_UNAVAILABLE) == (2, 75)  # EX_TEMPFAIL: rerun later
