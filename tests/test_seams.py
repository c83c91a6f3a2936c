"""Where the parts meet: a retried upload, a save's unexpected answer, a worker's log in a
bucket, two runs on one workdir, config mistakes found before the workdir is touched, a
missing workdir, a killed worker (issue 48)."""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from replicator import storage
from replicator.errors import StorageUnavailableError
from replicator.runtime.gcs_server import LocalGCS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------- the GCS server


def _begin_upload(url: str, bucket: str, name: str) -> str:
    """Starts a resumable upload of ``name``; returns the session's URL."""
    request = urllib.request.Request(
        f"{url}/upload/storage/v1/b/{bucket}/o?uploadType=resumable&name={name}",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return answer.headers["Location"]


def _put(session: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(
        session, data=data, method="PUT",
        headers={"Content-Range": f"bytes 0-{len(data) - 1}/{len(data)}"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}


def test_a_retried_put_to_a_completed_upload_answers_with_the_object(gcs_server, bucket):
    name = bucket.removeprefix("gs://")
    session = _begin_upload(gcs_server, name, "run/commit_success.txt")
    first = _put(session, b"done")
    # The reply was lost; the client sends the last chunk again, as gcsfs does.
    again = _put(session, b"done")
    assert first[0] == 200 and again[0] == 200
    assert again[1]["generation"] == first[1]["generation"]
    assert again[1]["name"] == "run/commit_success.txt"


def test_a_restarted_server_still_knows_completed_uploads(tmp_path):
    server = LocalGCS(tmp_path / "gcs").start()
    try:
        server.create_bucket("seams")
        session = _begin_upload(server.url, "seams", "a")
        status, first = _put(session, b"12345")
        assert status == 200
        server.stop()
        server.start()  # the outage tests stop and restart it
        status, again = _put(session, b"12345")
        assert status == 200 and again["generation"] == first["generation"]
    finally:
        server.stop()


# ---------------------------------------------------------------- a save's unexpected answer


def test_a_lost_upload_session_during_a_save_is_an_outage_not_a_bug():
    # gcsfs's error for a 404 from an upload session (what the commit of a checkpoint
    # met when the server had finished the upload and the reply was lost).
    lost = FileNotFoundError(
        "http://127.0.0.1:9/upload/storage/v1/b/b/o?name=run/checkpoints/300/"
        "commit_success.txt&uploadType=resumable&upload_id=b%3Arun"
    )
    try:
        raise RuntimeError("Orbax's async commit failed") from lost
    except RuntimeError as e:
        error = storage.failure(e, "save checkpoint 300 in", "gs://b/run/checkpoints")
    assert isinstance(error, StorageUnavailableError)
    assert "\n" not in str(error) and "checkpoint 300" in str(error)
    # A missing file is still the caller's to judge.
    assert storage.failure(FileNotFoundError("gs://b/run/x"), "read", "gs://b/run") is None


# An upload of the commit marker (gcsfs), of the checkpoint's metadata (gcsfs, resumable)
# and of an array's data (tensorstore), answered with what no client expects there.
UNEXPECTED = [
    (400, r"state/commit_success\.txt"),
    (410, r"state/commit_success\.txt"),
    (412, r"_CHECKPOINT_METADATA"),
    (400, r"ocdbt\.process_0(/|%2F)d(/|%2F)"),
]


@pytest.mark.parametrize("status, pattern", UNEXPECTED, ids=lambda x: str(x)[:12])
def test_an_unexpected_answer_during_a_save_is_one_line_not_a_traceback(status, pattern):
    import fsspec
    import jax.numpy as jnp

    import replicator as rp
    from tests import gcs

    with gcs.answering(status, pattern) as (_, hits):
        fsspec.filesystem("gcs").mkdir("seams-save")
        checkpoints = rp.Checkpoints("gs://seams-save/run/checkpoints", rp.Replicator())
        state = {"w": jnp.ones((4, 4)), "b": jnp.arange(3.0)}
        with pytest.raises(StorageUnavailableError) as raised:
            checkpoints.save(1, state, config={"seed": 0})
            checkpoints.wait()  # (the arrays and the commit are written in the background)
        assert hits, "the server never gave the answer: the test tests nothing"
        message = str(raised.value)
        assert "\n" not in message and len(message) < 500
        assert message.startswith("cannot save ") and "gs://seams-save/run/checkpoints" in message
        assert checkpoints.all_steps() == []  # not committed: a rerun resumes from before


# ---------------------------------------------------------------- a worker's log in a bucket


def _vanishing_after_is_dir(monkeypatch, workdir: str, probe: str) -> None:
    """Between listdir's look at ``workdir`` and its listing, ``probe`` (its only object)
    goes, as another process's write check removes its probe: the race behind the
    rehearsal's "Cannot write a log in gs://rehearsal/digits: b/rehearsal/o/digits"."""
    real = storage.path

    class Racing:
        def __init__(self, p):
            self.real = real(p)

        def is_dir(self):
            answer = self.real.is_dir()
            real(probe).unlink()
            return answer

        def iterdir(self):
            return self.real.iterdir()

    monkeypatch.setattr(storage, "path", lambda p: Racing(p) if str(p) == workdir else real(p))


def test_listing_a_prefix_whose_last_object_just_went_is_empty(bucket, monkeypatch):
    workdir, probe = f"{bucket}/digits", f"{bucket}/digits/.replicator-write-check-0"
    storage.write_bytes(probe, b"")
    _vanishing_after_is_dir(monkeypatch, workdir, probe)
    assert storage.listdir(workdir) == []


_LOG_TO = """
import sys
from tests.test_seams import _vanishing_after_is_dir
from replicator import storage
from replicator.trainer.console import Console

class Patch:  # pytest's monkeypatch, in this process
    setattr = staticmethod(setattr)

workdir, probe = sys.argv[1], sys.argv[2]
console = Console(verbose=False)
_vanishing_after_is_dir(Patch, workdir, probe)
console.log_to(workdir, 1, "train", create=True)
print("a line of process 1")
console.close()
"""


def test_a_worker_writes_its_log_while_another_removes_its_write_check(bucket):
    import subprocess
    import sys

    workdir, probe = f"{bucket}/digits", f"{bucket}/digits/.replicator-write-check-0"
    storage.write_bytes(probe, b"")
    done = subprocess.run([sys.executable, "-c", _LOG_TO, workdir, probe], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Cannot write a log" not in done.stderr
    assert "a line of process 1" in storage.read_text(f"{workdir}/log.process_1.txt")


# ---------------------------------------------------------------- one run per workdir

_HOLD = """
import sys, time
from replicator.trainer import lease
with lease.hold(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_run_on_a_local_workdir_is_refused_until_the_first_ends(tmp_path):
    import subprocess
    import sys

    from replicator.errors import WorkdirBusyError
    from replicator.trainer import lease

    workdir = str(tmp_path / "run")
    first = subprocess.Popen([sys.executable, "-c", _HOLD, workdir], stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert first.stdout.readline().strip() == "held"
        with pytest.raises(WorkdirBusyError, match=rf"process {first.pid} on "):
            with lease.hold(workdir):
                pass
    finally:
        first.kill()  # SIGKILL: no chance to release anything
        first.wait()
    with lease.hold(workdir):  # the OS released the lock with the process
        pass


def test_a_bucket_lease_refuses_a_live_holder_and_expires_after_a_kill(bucket, monkeypatch):
    from replicator.errors import WorkdirBusyError
    from replicator.trainer import lease

    monkeypatch.setattr(lease, "RENEW_S", 0.2)
    monkeypatch.setattr(lease, "EXPIRY_S", 1.5)
    monkeypatch.setattr(lease, "_POLL_S", 0.1)
    workdir = f"{bucket}/run"
    with lease.hold(workdir):
        with pytest.raises(WorkdirBusyError, match=rf"process {os.getpid()} on "):
            with lease.hold(workdir):
                pass
    with lease.hold(workdir):  # released: free at once
        pass
    # A holder killed mid-run: its renewals stop, and the lease object stays behind.
    killed = lease._BucketLease(workdir)
    killed._stop.set()
    killed._thread.join()
    monkeypatch.setattr(lease, "_is_alive", lambda pid: True)  # as if on another host
    start = time.monotonic()
    with lease.hold(workdir):
        pass
    assert 1.0 < time.monotonic() - start < 10


def _config(name: str, mode: str = "smoke", **overrides):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, f"{ROOT}/configs/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(mode)
    config.update(overrides)
    return config


def test_a_run_is_refused_while_another_holds_its_workdir(tmp_path, digits_data_dir):
    from replicator import trainer
    from replicator.errors import WorkdirBusyError
    from replicator.trainer import lease

    workdir = str(tmp_path / "run")
    config = _config("digits_cnn", data_dir=digits_data_dir, num_train_steps=2)
    with lease.hold(workdir):
        with pytest.raises(WorkdirBusyError, match=rf"process {os.getpid()} on .*lease.lock"):
            trainer.train_and_evaluate(config, workdir, quiet=True)
        assert os.listdir(workdir) == ["lease.lock"]  # nothing of the refused run's
        with open(os.path.join(workdir, "lease.lock")) as f:
            assert json.load(f)["pid"] == os.getpid()  # the holder's, as it was


# ---------------------------------------------------------------- config mistakes


def _files(workdir) -> dict[str, bytes]:
    found = {}
    for root, _, names in os.walk(workdir):
        for name in names:
            if name not in ("log.txt", "lease.lock"):
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    found[os.path.relpath(path, workdir)] = f.read()
    return found


@pytest.mark.slow  # trains the LM first: 38 s on a loaded 2-core machine (fast siblings below)
def test_a_refused_pipeline_config_leaves_a_finished_run_as_it_was(tmp_path):
    from replicator import trainer
    from replicator.errors import ConfigError
    from replicator.trainer.evaluator import run_config

    workdir = str(tmp_path / "run")
    config = _config("lm_tiny", num_train_steps=1, eval_every_steps=1, checkpoint_every_steps=1)
    trainer.train_and_evaluate(config, workdir, quiet=True)
    before = _files(workdir)
    bad = _config("lm_tiny", mesh={"stage": 2, "data": 4}, pipeline_microbatches=3)
    with pytest.raises(ConfigError, match="pipeline"):
        trainer.train_and_evaluate(bad, workdir, quiet=True)
    assert _files(workdir) == before  # config.json, metrics.jsonl, checkpoints, events
    assert trainer.evaluate(run_config(workdir), workdir)["step"] == 1  # `eval --workdir`


LM_MISTAKES = [
    ({"mesh": {"stage": 2, "data": 4}, "pipeline_microbatches": 3}, "microbatches|layers"),
    ({"mesh": {"stage": 2, "data": 4}, "model.num_experts": 4}, r"num_experts=4 with a pipeline"),
    ({"model.num_experts": 4, "model.expert_capacity_factor": 0.0}, "capacity_factor=0.0"),
    ({"model.num_experts": 4, "mesh": {"expert": 8}}, "4 experts do not split over the 8"),
    (
        {"model.max_len": 60, "mesh": {"context": 8}},
        "a sequence of 60 tokens does not split into 8 equal chunks over mesh axis 'context'",
    ),
    (
        {"model.max_len": 62, "mesh": {"context": 2, "data": 4}, "context_load_balance": True},
        "of 62 tokens does not split into 4 equal chunks .* of 2, two each",
    ),
]


@pytest.mark.parametrize("overrides, match", LM_MISTAKES, ids=lambda x: str(x)[:40])
def test_a_parallelism_mistake_is_one_config_error_before_the_workdir(tmp_path, overrides, match):
    from replicator import trainer
    from replicator.errors import ConfigError

    config = _config("lm_tiny")
    for key, value in overrides.items():
        if key.startswith("model."):
            config.model[key.removeprefix("model.")] = value
        else:
            config[key] = value
    if "model.max_len" in overrides:
        text = tmp_path / "text.txt"
        text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
        config.dataset = f"text_files/block_size={config.model.max_len},files={text}"
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=match):
        trainer.train_and_evaluate(config, str(workdir), quiet=True)
    assert not workdir.exists()


def test_launch_local_refuses_zero_processes(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "replicator", "launch", "local", "--processes", "0", "--",
         "train", "--config", "configs/digits_cnn.py:smoke", "--workdir", str(tmp_path / "r")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.splitlines() == ["error: launch local --processes 0: give 1 or more"]
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- eval of a missing workdir


@pytest.mark.parametrize("with_config", [False, True])
def test_eval_of_a_missing_workdir_says_it_does_not_exist(tmp_path, with_config):
    import subprocess
    import sys

    config = ["--config", "configs/digits_cnn.py:smoke"] if with_config else []
    done = subprocess.run(
        [sys.executable, "-m", "replicator", "eval", *config, "--workdir", str(tmp_path / "rnu")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: --workdir {tmp_path / 'rnu'} does not exist (a mistyped path?)"
    )


# ---------------------------------------------------------------- a killed worker

_PEERS = """
import os, signal, sys, time
me, mark = os.environ["REPLICATOR_PROCESS_ID"], sys.argv[1]
if me == "1":
    open(mark, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a preemption does
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the survivor gets to print its error
while not os.path.exists(mark):
    time.sleep(0.01)
time.sleep(0.3)
raise RuntimeError("gloo: Connection reset by peer (what a survivor of a killed peer says)")
"""


def test_a_killed_worker_reads_as_a_resumable_run_not_a_crash(tmp_path, capsys, monkeypatch):
    from replicator.runtime import launch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    script = tmp_path / "peers.py"
    script.write_text(_PEERS)
    code = launch.launch_local(
        ["python", str(script), str(tmp_path / "killed")], processes=2, devices_per_process=1,
        grace_s=10,
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code != 0
    assert err.strip().splitlines() == [
        "launch: process 1 was killed (SIGKILL), not a failure of the run: rerun the same "
        "command to resume from its last checkpoint (--restarts N does it by itself)."
    ]
    assert "Traceback" not in out  # the survivor's error is kept, off the console
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("replicator-launch-0-")]
    assert len(kept) == 1 and "Connection reset by peer" in kept[0].read_text()
    assert f"[0] (its error once another process was killed: {kept[0]})" in out


def test_a_failing_worker_keeps_its_traceback_on_the_console(tmp_path, capsys):
    from replicator.runtime import launch

    script = tmp_path / "bug.py"
    script.write_text("import os\nif os.environ['REPLICATOR_PROCESS_ID'] == '1': 1 / 0\n")
    code = launch.launch_local(["python", str(script)], processes=2, devices_per_process=1)
    out, err = capsys.readouterr()
    assert code == 1 and "process 1 failed with exit code 1" in err
    assert "[1] Traceback (most recent call last)" in out and "ZeroDivisionError" in out


@pytest.mark.parametrize("code", [0, 1])
def test_a_rehearsal_advises_evaluating_only_a_run_that_succeeded(tmp_path, capsys, code):
    from replicator.runtime import rehearse

    command = ["train", "--config", "c.py", "--workdir", "gs://rehearsal-seams/run"]
    outcome = {}
    with rehearse.rehearsal(command, 1, directory=str(tmp_path / "gcs"), outcome=outcome):
        outcome["code"] = code
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert ("Evaluate it with" in last) == (code == 0)
    assert "gs://rehearsal-seams/run stays in" in last
