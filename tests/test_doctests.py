"""Every module's docstring examples run, once: the library's, the trainer's, the runtime's
and the experiments' (a module without examples passes trivially)."""

import doctest
import importlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _modules() -> list[str]:
    names = []
    for package in ("replicator", "experiments"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] != "__main__":
                names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.parametrize("module", _modules())
def test_docstring_examples_run(module, monkeypatch):
    monkeypatch.chdir(ROOT)  # (examples name configs/ by their paths)
    result = doctest.testmod(
        importlib.import_module(module),
        extraglobs={"jnp": jnp, "np": np, "jax": jax, "rp": rp},
        optionflags=doctest.ELLIPSIS,
    )
    assert result.failed == 0
