"""The shipped config files as tests read them, and a run's records.

`load_config` reads any file of configs/ by name or path (its mode and overrides
applied), `digits_config` the default example's; `read_records` a workdir's
``metrics.jsonl``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import types

import ml_collections

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "configs"


def config_module(config: str | os.PathLike) -> types.ModuleType:
    """The config file's module: ``config`` a name in configs/ (``"lm_tiny"``) or a path."""
    path = pathlib.Path(config)
    if path.suffix != ".py":
        path = CONFIG_DIR / f"{config}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_config(
    config: str | os.PathLike, mode: str = "smoke", **overrides
) -> ml_collections.ConfigDict:
    """``get_config(mode)`` of the config file (`config_module`), ``overrides`` set on it."""
    values = config_module(config).get_config(mode)
    values.update(overrides)
    return values


def digits_config(mode: str = "smoke", **overrides) -> ml_collections.ConfigDict:
    """configs/digits_cnn.py, the offline example most trainer tests run."""
    return load_config("digits_cnn", mode, **overrides)


def read_records(workdir: str | os.PathLike) -> list[dict]:
    """Every record of ``WORKDIR/metrics.jsonl``, in order."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
