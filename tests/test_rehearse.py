"""`launch local --gcs`: a pod rehearsed on one machine, as a new user runs it: a local
GCS server started and stopped by the launcher, its buckets created, each process on
a disk of its own, the objects kept for the next run, a local workdir refused."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from replicator.errors import LaunchError
from replicator.runtime import gcs_server, launch, rehearse

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Each process: what it sees, and one object of its own in the bucket the command names.
PROCESS = """import os, sys
from replicator import storage

i = os.environ["REPLICATOR_PROCESS_ID"]
home = os.environ["HOME"]
open(os.path.join(home, "mine.txt"), "w").write(i)  # a disk of its own: no one else's file
storage.write_text(sys.argv[1] + f"/process-{i}.txt", f"from {i}")
variables = [os.environ[v] for v in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
                                     "GOOGLE_AUTH_TOKEN_FOR_TESTING")]
print("home", home, "tmp", os.environ["TMPDIR"].startswith(home), "variables", *variables)
print("sees", sorted(os.listdir(home)))
"""


def run_launch(argv, cwd, capsys, monkeypatch) -> subprocess.CompletedProcess:
    """``python -m replicator launch local ARGV`` in ``cwd``, in this process."""
    monkeypatch.chdir(cwd)
    code = launch.main(["local", *argv])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, captured.out, captured.err)


def _answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_rehearsal_gives_each_process_a_disk_and_shares_only_the_bucket(
    tmp_path, capsys, monkeypatch
):
    (tmp_path / "process.py").write_text(PROCESS)
    store = tmp_path / "gcs"
    rehearsal = ["--gcs", "--gcs-dir", str(store)]
    done = run_launch(
        ["--processes", "2", *rehearsal, "--", "python", "process.py", "gs://rehearsal/run"],
        tmp_path,
        capsys,
        monkeypatch,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("launch: a pod rehearsed: 2 processes, each with a disk of its own")
    assert f"(objects kept in {store})" in lines[0]
    assert lines[1] == "launch: buckets gs://rehearsal"  # created: the command names it
    homes = set()
    for i in range(2):
        (said,) = [line for line in done.stdout.splitlines() if line.startswith(f"[{i}] home")]
        words = said.split()
        homes.add(words[2])
        assert words[3:6] == ["tmp", "True", "variables"]
        url = words[6]
        assert url.startswith("http://127.0.0.1:") and words[7] == url and words[8]
        assert f"[{i}] sees ['.cache', 'mine.txt', 'tensorflow_datasets', 'tmp']" in done.stdout
    assert len(homes) == 2 and not any(os.path.exists(h) for h in homes)  # removed after

    # The objects outlive the server: the next one (the next rehearsal's) lists them.
    with gcs_server.LocalGCS(store) as server:
        listing = urllib.request.urlopen(f"{server.url}/storage/v1/b/rehearsal/o?prefix=run/")
        names = [item["name"] for item in json.load(listing)["items"]]
    assert names == ["run/process-0.txt", "run/process-1.txt"]


def test_a_local_workdir_in_a_rehearsal_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    command = ["train", "--config", "configs/digits_cnn.py", "--workdir", "runs/x"]
    argv = ["local", "--processes", "2", "--gcs", "--gcs-dir", str(tmp_path / "gcs")]
    assert launch.main([*argv, "--", *command]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line == (
        "error: --workdir runs/x is a local path, which the 2 processes of this rehearsal "
        "share, but a pod's workers would not (each would keep its own checkpoints, metrics "
        "and data). Give a gs:// path on the rehearsal's server (e.g. gs://rehearsal/run), "
        "or --allow-local-workdir to run it anyway."
    )
    assert captured.out == "" and not (tmp_path / "gcs").exists()  # nothing started


def test_without_the_emulator_a_rehearsal_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(rehearse, "have_emulator", lambda: False)
    argv = ["local", "--processes", "2", "--gcs", "--", "python", "x.py", "gs://b/run"]
    assert launch.main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "error: launch local --gcs runs a local GCS server, which needs gcp-storage-emulator: "
        "pip install -e '.[rehearse]'"
    )


def test_one_server_per_directory(tmp_path):
    with gcs_server.LocalGCS(tmp_path) as first:
        first.create_bucket("rehearsal")
        first.create_bucket("rehearsal")  # one that exists is kept
        with pytest.raises(LaunchError, match=f"keeps its objects in {tmp_path}"):
            gcs_server.LocalGCS(tmp_path).start()


def test_the_tests_server_script_still_serves(tmp_path):
    port = gcs_server.free_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "gcs_server.py"), str(port)])
    try:
        deadline = time.monotonic() + 30
        while not _answers(port):
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.2)
        gcs_server.LocalGCS(port=port).create_bucket("readonly-x")
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.slow
def test_the_pods_page_rehearsal(tmp_path, capsys, monkeypatch):
    """docs/pods.md's first commands, as written (the objects in a directory of the test's)."""
    store = ["--gcs-dir", str(tmp_path / "gcs")]
    train = ["train", "--config", "configs/digits_cnn.py", "--workdir", "gs://rehearsal/digits"]
    done = run_launch(
        ["--processes", "2", "--gcs", *store, "--", *train, "--config.num_train_steps=20"],
        ROOT,
        capsys,
        monkeypatch,
    )
    assert done.returncode == 0, done.stderr
    assert "launch: buckets gs://rehearsal; the workdir: gs://rehearsal/digits" in done.stderr
    assert "[0] Final test metrics after 20 steps" in done.stdout
    done = run_launch(
        ["--processes", "1", "--gcs", *store, "--", "eval", "--workdir", "gs://rehearsal/digits"]
        + ["--json"],
        ROOT,
        capsys,
        monkeypatch,
    )
    assert done.returncode == 0, done.stderr
    assert '"step": 20' in done.stdout
