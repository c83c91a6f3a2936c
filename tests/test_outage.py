"""A storage outage: ridden out when shorter than the deadline, else one line in time.

A run trains with its workdir in a bucket on a local GCS server that keeps its
objects on disk (`replicator.runtime.gcs_server.LocalGCS`), which is stopped mid-run
and started again on the same port: what a run sees when the storage goes away
(refused connections) and comes back. An outage shorter than the storage deadline
(`replicator.storage.DEADLINE_S`, 60 s) is ridden out, every path included (Orbax's
commit through gcsfs, tensorstore's array writes, the record uploads); a longer
one ends the run within that bound in one line with exit status 75, and a rerun
sets the half-written step aside and resumes bitwise.
"""

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import jax
import numpy as np
import pytest

from replicator import storage
from replicator.runtime.gcs_server import LocalGCS
from replicator.trainer import cli
from tests import gcs
from tests.helpers.configs import read_records
from tests.test_checkpoint import final_params, tensorboard_scalars
from tests.test_gcs import (
    CONFIG,
    RUN_FLAGS,
    finish,
    local_reference,  # noqa: F401  (a fixture)
    without_timing,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "outage"


@pytest.fixture
def stoppable_gcs(tmp_path):
    """A local GCS server that keeps its objects in a directory, so that it can be stopped
    and started again on the same port."""
    server = LocalGCS(tmp_path / "gcs").start()
    server.create_bucket(BUCKET)
    yield server
    server.stop()


def train(server, workdir, data_dir, cwd):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", **server.environ)
    return subprocess.Popen(
        [sys.executable, "-m", "replicator", "train", "--config", CONFIG, "--workdir", workdir,
         f"--config.data_dir={data_dir}", *RUN_FLAGS],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def has_object(server, name: str) -> bool:
    quoted = urllib.parse.quote(name, safe="")
    try:
        urllib.request.urlopen(f"{server.url}/storage/v1/b/{BUCKET}/o/{quoted}", timeout=10).close()
        return True
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return False
        raise


def stop_after_checkpoint(server, proc, step: int) -> float:
    """Stops the server once checkpoint ``step`` is committed; returns when it stopped."""
    deadline = time.monotonic() + 240
    while not has_object(server, f"run/checkpoints/{step}/commit_success.txt"):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    server.stop()
    return time.monotonic()


def wait(proc, until: float) -> float | None:
    """Waits for ``proc`` until monotonic time ``until``; when it ended, returns when."""
    while time.monotonic() < until:
        if proc.poll() is not None:
            return time.monotonic()
        time.sleep(0.1)
    return None


def copy_of(server, url, local):
    """The run, copied out of the bucket (by another process: this one's gcsfs is the
    session server's)."""
    code = "import sys; from replicator import storage; storage.copy_tree(*sys.argv[1:])"
    subprocess.run([sys.executable, "-c", code, url, str(local)], cwd=ROOT, check=True,
                   env=dict(os.environ, **server.environ), timeout=120)  # fmt: skip
    return local


def assert_bitwise_equal(run, reference):
    assert without_timing(read_records(run)) == without_timing(read_records(reference))
    (step, params), (ref_step, ref_params) = final_params(run), final_params(reference)
    assert step == ref_step == 120
    jax.tree.map(np.testing.assert_array_equal, params, ref_params)
    want = tensorboard_scalars(reference / "tensorboard")["train/loss"]
    assert tensorboard_scalars(run / "tensorboard")["train/loss"] == want


@pytest.mark.slow  # a 40 s outage: about 70 s
def test_an_outage_shorter_than_the_deadline_is_ridden_out(
    tmp_path,
    stoppable_gcs,
    digits_data_dir,
    local_reference,  # noqa: F811
):
    workdir = f"gs://{BUCKET}/run"
    proc = train(stoppable_gcs, workdir, digits_data_dir, tmp_path)
    stopped = stop_after_checkpoint(stoppable_gcs, proc, 40)
    assert wait(proc, stopped + 40) is None, proc.communicate()[1][-3000:]  # still waiting
    stoppable_gcs.start()
    out, err = finish(proc)
    assert "Traceback" not in err and "error:" not in err, err[-3000:]
    assert_bitwise_equal(copy_of(stoppable_gcs, workdir, tmp_path / "copy"), local_reference)


@pytest.mark.slow  # a 90 s outage, then the rerun: about 2 minutes
def test_a_longer_outage_is_one_line_in_time_and_a_rerun_resumes_bitwise(
    tmp_path,
    stoppable_gcs,
    digits_data_dir,
    local_reference,  # noqa: F811
):
    workdir = f"gs://{BUCKET}/run"
    proc = train(stoppable_gcs, workdir, digits_data_dir, tmp_path)
    stopped = stop_after_checkpoint(stoppable_gcs, proc, 40)
    ended = wait(proc, stopped + 90)
    out, err = proc.communicate()
    assert ended is not None and ended - stopped < storage.DEADLINE_S + 10, err[-3000:]
    assert proc.returncode == cli.STORAGE_UNAVAILABLE == 75, err[-3000:]
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: cannot "), err
    assert f"gs://{BUCKET}/run" in errors[0] and "did not answer for" in errors[0]
    assert errors[0].endswith("nothing is lost: rerun the same command once the storage answers")

    time.sleep(max(0.0, stopped + 90 - time.monotonic()))  # the storage is back after 90 s
    stoppable_gcs.start()
    out, err = finish(train(stoppable_gcs, workdir, digits_data_dir, tmp_path))
    # (What step 80's save wrote before the outage, if anything, is moved aside first.)
    assert f"Resumed from step 40 in {workdir}/checkpoints" in err
    assert_bitwise_equal(copy_of(stoppable_gcs, workdir, tmp_path / "copy"), local_reference)


def test_a_storage_that_does_not_answer_is_one_line_with_exit_status_75(tmp_path):
    """Before the run starts (its bucket checked): one line, at once after the deadline
    (shortened here to 3 s), with the outage's own exit status."""
    silent = f"http://127.0.0.1:{gcs.free_port()}"  # nothing there: every connection refused
    # The deadline counts from the first request the storage left unanswered; what comes
    # before it (the imports, the config: half a minute on a loaded 2-core machine with
    # two xdist workers) is not timed. The run notes that moment, by the clock the
    # parent reads, in a file beside tmp_path.
    silent_since = tmp_path.parent / f"{tmp_path.name}.silent_since"
    env = dict(os.environ, STORAGE_EMULATOR_HOST=silent, TENSORSTORE_GCS_HTTP_URL=silent,
               GOOGLE_AUTH_TOKEN_FOR_TESTING="x")  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", NOTING_SILENCE, str(silent_since), "train", "--config", CONFIG,
         "--workdir", "gs://b/run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    waited = time.time() - float(silent_since.read_text())
    assert done.returncode == 75, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: cannot reach gs://b/run: the storage service did not answer")
    # Retried (0.5 s, then 1 s: giving up at once would be under 1 s), and given up near
    # the 3 s deadline, far below the default 60 s.
    assert 1.0 <= waited < 30, waited
    assert os.listdir(tmp_path) == []


# ``python -m replicator`` with a 3 s storage deadline, noting in the file given first
# the wall time of the first request the storage left unanswered (when its deadline
# starts counting).
NOTING_SILENCE = """
import pathlib, sys, time
from replicator import storage
from replicator.trainer import cli

storage.DEADLINE_S = 3.0
note, unanswered = pathlib.Path(sys.argv.pop(1)), storage._unanswered

def noted(asked):
    if not note.exists():
        note.write_text(repr(time.time() - (time.monotonic() - asked)))
    unanswered(asked)

storage._unanswered = noted
cli.run(["replicator", *sys.argv[1:]])
"""


def test_library_errors_of_a_storage_that_does_not_answer_are_storage_errors(monkeypatch):
    import aiohttp
    from gcsfs.retry import HttpError

    monkeypatch.setattr(storage, "_silent_since", None)  # failure() notes an outage
    refused = aiohttp.ClientConnectionError("Cannot connect to host 127.0.0.1:1")
    dropped = aiohttp.ServerDisconnectedError()
    tensorstore = ValueError(
        "ABORTED: All 9 retry attempts failed: CURL error Could not connect to server "
        "[tensorstore_spec='{...}']"
    )
    for error in (refused, dropped, HttpError({"code": 503, "message": "x"}), tensorstore):
        try:
            raise RuntimeError("an Orbax wrapper") from error
        except RuntimeError as wrapped:
            found = storage.failure(wrapped, "save checkpoint 80 in", "gs://b/run/checkpoints")
        assert isinstance(found, storage.StorageUnavailableError), error
        assert str(found).startswith("cannot save checkpoint 80 in gs://b/run/checkpoints: ")
        assert "\n" not in str(found) and "tensorstore_spec" not in str(found)
    for answer in (HttpError({"code": 404, "message": "x"}), FileNotFoundError("x"), KeyError(1)):
        assert storage.failure(answer, "read", "gs://b/x") is None
    denied = storage.failure(PermissionError("denied"), "write", "gs://b/x")
    assert type(denied) is storage.StorageError


def test_mirror_folders_of_killed_processes_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = storage._HOST
    names = {
        f"replicator-mirror-{gone.pid}@{host}-abc": False,  # killed: removed
        f"replicator-mirror-{os.getpid()}@{host}-def": True,  # alive
        f"replicator-mirror-{gone.pid}@another-host-ghi": True,  # another host's
        "replicator-mirror-jkl": True,  # an older version's: whose, unknown
    }
    for name in names:
        os.makedirs(tmp_path / name / "sub")
    storage._remove_orphaned_mirrors.__wrapped__()
    assert {name: (tmp_path / name).exists() for name in names} == names


def test_tensorstore_gives_up_on_a_bucket_within_the_deadline(bucket):
    import orbax.checkpoint as ocp

    import replicator as rp

    rp.Checkpoints(f"{bucket}/ckpt", rp.Replicator(devices=jax.devices()[:1])).close()
    retries = ocp.type_handlers.get_ts_context(use_ocdbt=True).spec.to_json()["gcs_request_retries"]
    assert retries["max_retries"] == storage.tensorstore_retries()["max_retries"]
