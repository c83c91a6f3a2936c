"""Every test sees 8 fake CPU devices, set before JAX initialises.

A test slow on CI's 2 cores (over about 20 s, or one whose invariant a faster test
holds) is marked where it is defined, ``@pytest.mark.slow  # why`` or
``pytest.param(..., marks=pytest.mark.slow)``: ``make test`` (two pytest-xdist
workers) leaves it out and keeps under 15 minutes, ``make test-slow`` runs it. A
mark travels with its test through renames and new parameters, where a list of
test ids would point at another case; ``--strict-markers`` refuses a misspelt one.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
    del config
    if jax.device_count() != 8:
        raise RuntimeError(
            f"tests need 8 fake CPU devices, JAX has {jax.device_count()}; was jax "
            "initialised before tests/conftest.py ran?"
        )


@pytest.fixture(scope="session")
def devices():
    return jax.devices()


@pytest.fixture(scope="session")
def digits_data_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tfds data_dir with the offline ``digits`` dataset built once per session."""
    import experiments.datasets  # noqa: F401  (registers the "digits" builder)
    from replicator.trainer import data

    path = str(tmp_path_factory.mktemp("tfds"))
    data.load_data_source("digits", "train", data_dir=path)  # builds both splits
    return path


@pytest.fixture(scope="session")
def gcs_server():
    """A real GCS JSON API server (gcp-storage-emulator) on 127.0.0.1 for the session.

    The client libraries reach it through their own variables only, set here for
    this process and every subprocess a test starts: ``STORAGE_EMULATOR_HOST``
    (google-cloud-storage, gcsfs) and ``TENSORSTORE_GCS_HTTP_URL`` with
    ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` (tensorstore, Orbax's array writer).
    """
    from tests import gcs

    with gcs.emulator() as url:
        yield url


@pytest.fixture
def bucket(gcs_server) -> str:
    """A fresh, empty bucket on the session's GCS server: ``gs://NAME``."""
    from tests import gcs

    return gcs.new_bucket()
