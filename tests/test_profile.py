"""Profiling a pod: traces of chosen steps under the workdir (local or gs://), and traces
of every process at once, captured on demand from the profiler servers of a running job."""

import gzip
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from jax.profiler import ProfileData

from replicator import storage, trainer
from replicator.trainer import actions
from replicator.trainer.config import ConfigError, validate
from tests import gcs
from tests.helpers.configs import digits_config
from tests.test_multiprocess import train_2x4

ROOT = pathlib.Path(__file__).resolve().parent.parent
XPROF = os.path.join(os.path.dirname(sys.executable), "xprof")  # the `profile` extra's server


def consecutive_free_ports(n: int) -> int:
    """A port ``p`` with ``p .. p+n-1`` all free on this host."""
    for _ in range(100):
        base = gcs.free_port()
        if base + n <= 65536 and all(is_free(base + i) for i in range(1, n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def is_free(port: int) -> bool:
    try:
        socket.create_server(("", port)).close()
        return True
    except OSError:
        return False


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


def assert_a_training_trace(xspace: bytes) -> None:
    """``xspace`` (an ``.xplane.pb``) holds host events of train steps being dispatched
    and device events of their XLA ops running (the CNN's convolutions; on a CPU host
    the device's work is on the XLA client's threads, on a GPU in ``/device:GPU:N``)."""
    names = set()
    for plane in ProfileData.from_serialized_xspace(xspace).planes:
        for line in plane.lines:
            names.update(event.name for event in line.events)
    assert any(n.startswith("PjitFunction(") and "train_step" in n for n in names), sorted(names)
    assert any("convolution" in n or n.startswith("conv_general") for n in names), sorted(names)


def xplanes(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(directory.glob("plugins/profile/*/*.xplane.pb"))


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=120) as answer:
        body = answer.read()
        if answer.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
    return json.loads(body)


def wait_for(condition, what: str, *alive: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert all(p.poll() is None for p in alive), f"exited before {what}"
        assert time.monotonic() < deadline, f"no {what} in {timeout_s} s"
        time.sleep(0.2)


def test_capture_every_process_of_a_running_job_on_demand(tmp_path, digits_data_dir):
    """A 2-process job with ``profile_port``: xprof's "Capture Profile" (the request its
    button sends) with both processes' addresses traces both at once, while the job
    trains; ``profile_steps`` leaves one trace per process in the workdir."""
    pytest.importorskip("xprof", reason="the capture client: pip install -e '.[profile]'")
    port, web, grpc = consecutive_free_ports(2), gcs.free_port(), gcs.free_port()
    workdir, captures = tmp_path / "run", tmp_path / "captures"
    captures.mkdir()
    with open(tmp_path / "job.out", "w") as out:
        job = subprocess.Popen(
            train_2x4(
                "--config",
                "configs/digits_cnn.py",
                "--workdir",
                str(workdir),
                f"--config.data_dir={digits_data_dir}",
                "--config.num_train_steps=100000",  # runs until stopped below
                "--config.eval_every_steps=100000",
                "--config.checkpoint_every_steps=100000",
                "--config.log_every_steps=5",
                "--config.profile_steps=2,3",
                f"--config.profile_port={port}",
                "--quiet",
            ),  # fmt: skip
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, to end it whole on a failure
        )
    server = subprocess.Popen(
        [XPROF, f"--logdir={captures}", f"--port={web}", f"--grpc_port={grpc}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        metrics = workdir / "metrics.jsonl"
        # A train record: both processes are past setup, their servers up, stepping.
        wait_for(lambda: metrics.exists() and metrics.read_text(), "train record", job)
        wait_for(lambda: listening(web), "xprof server", server)
        assert listening(port) and listening(port + 1)
        addresses = f"127.0.0.1:{port},127.0.0.1:{port + 1}"
        answer = get_json(
            f"http://127.0.0.1:{web}/data/plugin/profile/capture_profile"
            f"?service_addr={addresses}&duration=2000"
        )
        assert "error" not in answer, answer
        job.send_signal(signal.SIGTERM)  # a preemption: checkpoint, then exit
        assert job.wait(timeout=180) == 0, (tmp_path / "job.out").read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        server.terminate()
        server.wait(timeout=30)
    output = (tmp_path / "job.out").read_text()
    assert f"[0] Profiler servers on ports {port}-{port + 1}, process i on port" in output
    assert not listening(port) and not listening(port + 1)
    # One capture session, one trace per process, named by its address.
    (session,) = (captures / "plugins" / "profile").iterdir()
    names = sorted(p.name for p in session.iterdir())
    assert names == [f"127.0.0.1_{port}.xplane.pb", f"127.0.0.1_{port + 1}.xplane.pb"]
    for name in names:
        assert_a_training_trace((session / name).read_bytes())
    # profile_steps: each process traced steps 2-3 into its own directory.
    assert sorted(p.name for p in (workdir / "profile").iterdir()) == ["process_0", "process_1"]
    for i in (0, 1):
        (trace,) = xplanes(workdir / "profile" / f"process_{i}")
        assert_a_training_trace(trace.read_bytes())


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_profile_steps_on_a_bucket_land_in_the_bucket(tmp_path, bucket, digits_data_dir):
    """jaxlib's own gs:// writer cannot reach a bucket but Google's: the trace is taken
    into a temporary directory and uploaded through the storage layer, leaving nothing."""
    worker, temp = tmp_path / "worker", tmp_path / "tmp"
    worker.mkdir()
    temp.mkdir()
    workdir = f"{bucket}/runs/profiled"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "replicator",
            "train",
            "--config",
            str(ROOT / "configs" / "digits_cnn.py:smoke"),
            "--workdir",
            workdir,
            f"--config.data_dir={digits_data_dir}",
            "--config.profile_steps=2,3",
            "--quiet",
        ],  # fmt: skip
        cwd=worker,
        env={**os.environ, "TMPDIR": str(temp)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    traces = [o for o in gcs.list_objects(workdir) if o.endswith(".xplane.pb")]
    assert len(traces) == 1 and traces[0].startswith("profile/process_0/plugins/profile/"), traces
    assert_a_training_trace(storage.read_bytes(f"{workdir}/{traces[0]}"))
    assert os.listdir(worker) == []  # no gs:/ folder
    assert [p for p in os.listdir(temp) if p.startswith("replicator-profile-")] == []


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_the_profiler_server_runs_while_training_and_stops_after(tmp_path, digits_data_dir):
    port = gcs.free_port()
    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            seen.append(listening(port))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        config = digits_config(data_dir=digits_data_dir, profile_port=port)
        trainer.train_and_evaluate(config, str(tmp_path / "run"), quiet=True)
    finally:
        done.set()
        watcher.join()
    assert any(seen) and not listening(port)


def test_a_busy_port_is_a_warning_not_a_silent_failure(caplog):
    with socket.create_server(("", gcs.free_port())) as taken:
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="replicator"):
            assert not actions._start_profiler_server(port)
    assert f"No profiler server on port {port}" in caplog.text


@pytest.mark.parametrize("port", [0, 65536])
def test_profile_port_must_be_a_port(port):
    with pytest.raises(ConfigError, match="'profile_port' must be a port"):
        validate(digits_config(profile_port=port))
