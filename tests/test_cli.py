"""The command line as a new user meets it: help, one-line errors, corrupt checkpoints,
eval's config, a quiet console. Each test runs ``python -m replicator`` in a
subprocess on 2 fake CPU devices and the offline digits."""

import json
import os
import pty
import re
import shutil
import subprocess
import threading

import pytest

from replicator.trainer.config import describe_keys, experiment_keys
from tests.helpers.cli import ROOT, SMOKE, assert_one_line_error, lines, run_cli
from tests.helpers.configs import read_records


@pytest.fixture(scope="module")
def fresh_data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fresh_tfds"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, fresh_data_dir):
    """A smoke run with a model override, in a data_dir that tfds prepares on the way."""
    workdir = str(tmp_path_factory.mktemp("cli") / "run")
    done = run_cli(
        "train", *SMOKE, "--workdir", workdir, f"--config.data_dir={fresh_data_dir}",
        "--config.model.dense_features=32",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return workdir, done, f"--config.data_dir={fresh_data_dir}"


# ---- Help


def test_help_lists_the_subcommands():
    done = run_cli("--help")
    assert done.returncode == 0
    for command in ("train", "eval", "plot", "launch"):
        (line,) = [x for x in done.stdout.splitlines() if x.startswith(f"  {command} ")]
        assert len(line.split()) > 3  # a one-line description
    assert_one_line_error(run_cli("trian"), "unknown command 'trian'", "did you mean 'train'")


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_train_and_eval_help_list_flags_and_every_config_key():
    for command, flags in [
        ("train", ["--config", "--workdir", "--[no]quiet", "--[no]force", "--[no]debug"]),
        ("eval", ["--config", "--workdir", "--step", "--[no]follow", "--[no]verbose"]),
    ]:
        done = run_cli(command, "--help")
        assert done.returncode == 0, done.stderr
        for flag in flags:
            assert re.search(rf"^  {re.escape(flag)} +\S", done.stdout, re.M), flag
        for key, default, meaning in describe_keys():
            assert re.search(
                rf"^  {key} +{re.escape(default)} +{re.escape(meaning)}$", done.stdout, re.M
            ), key
    done = run_cli("launch", "--help")
    assert done.returncode == 0 and all(k in done.stdout for k in ("local", "tpu", "slurm"))


def test_help_with_a_config_shows_its_values_and_its_experiments_keys():
    done = run_cli("train", *SMOKE, "--config.batch_size=32", "--help")
    assert done.returncode == 0, done.stderr
    assert re.search(r"^  batch_size +\(required\) +32 +global batch", done.stdout, re.M)
    assert re.search(r"^  num_train_steps +\(required\) +4 ", done.stdout, re.M)
    assert re.search(r"^  model.dense_features +64 +64 +cnn: the dense", done.stdout, re.M)
    assert "remat_policy" not in done.stdout  # the LM's key, not the classifiers'
    done = run_cli("train", "--config", "configs/lm_tiny.py:smoke", "--config.model.num_experts=4",
                   "--config.model.mlp_dim=None", "--config.mesh.stage=2", "--help")  # fmt: skip
    assert done.returncode == 0, done.stderr
    for key, default, meaning in describe_keys(experiment_keys("experiments.lm")):
        row = rf"^  {re.escape(key)} +{re.escape(default)} +.*{re.escape(meaning)}$"
        assert re.search(row, done.stdout, re.M), key
    assert re.search(r"^  model.num_experts +None +4 +experts of a mixture", done.stdout, re.M)
    assert re.search(r"^  model.mlp_dim +None +None +the MLP", done.stdout, re.M)


# ---- One-line errors


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--config.learnin_rate=0.1"], ["unknown config key 'learnin_rate'", "'learning_rate'"]),
        (["--config.model.num_clases=3"], ["'model.num_clases'", "'model.num_classes'"]),
        (["--config.batch_size=abc"], ["--config.batch_size=abc", "invalid literal for int"]),
        (["--config.precision=fp8"], ["'precision'='fp8' is not one of"]),
        (["--config.model.newkey=1"], ["unknown config key 'model.newkey'", "config.model has"]),
        (["--config.model.hiddn=3"], ["unknown config key 'model.hiddn'", "num_classes"]),
    ],
)
def test_config_mistakes_are_one_line_and_touch_nothing(tmp_path, args, expected):
    workdir = tmp_path / "run"
    assert_one_line_error(run_cli("train", *SMOKE, "--workdir", str(workdir), *args), *expected)
    assert not workdir.exists()


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_missing_config_file_and_flags_are_one_line(tmp_path):
    workdir = str(tmp_path / "run")
    done = run_cli("train", "--config", "configs/nope.py", "--workdir", workdir)
    assert_one_line_error(done, "config file 'configs/nope.py' does not exist")
    done = run_cli("train", *SMOKE, "--workdir", workdir, "--config.learnin_rate=1",
                   env={"REPLICATOR_DEBUG": "1"})  # fmt: skip
    assert done.returncode == 2 and "Traceback (most recent call last)" in done.stderr
    assert_one_line_error(run_cli("train", *SMOKE), "--workdir is required")
    assert_one_line_error(run_cli("eval", "--workdir", workdir), f"{workdir} does not exist (a")
    os.makedirs(workdir)  # a directory, but no run's
    assert_one_line_error(run_cli("eval", "--workdir", workdir), "config.json does not exist")


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_mistakes_in_batch_and_mesh_then_a_corrected_run_succeeds(tmp_path, digits_data_dir):
    common = ["train", *SMOKE, "--workdir", str(tmp_path), f"--config.data_dir={digits_data_dir}"]
    done = run_cli(*common, "--config.batch_size=33", "--config.eval_every_steps=4")
    assert_one_line_error(done, "batch_size=33", "2 replicas", "multiple of 2")
    assert_one_line_error(run_cli(*common, "--config.mesh.data=3"), "3 devices but 2")
    done = run_cli(*common, "--config.mesh.data=3", "--debug")
    assert done.returncode == 2 and "Traceback (most recent call last)" in done.stderr
    done = run_cli(*common, "--config.batch_size=32")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Final test metrics after 4 steps" in done.stdout


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_a_workdir_of_another_experiment_is_refused_unless_forced(trained):
    workdir, _, data_dir = trained
    common = ["train", *SMOKE, "--workdir", workdir, data_dir, "--config.num_train_steps=6"]
    done = run_cli(*common)
    assert_one_line_error(done, "another experiment", "model.dense_features: 32 -> 64", "--force")
    done = run_cli(*common, "--force")
    # Forced onto the checkpoints of the other model: they do not fit, said in one line.
    assert_one_line_error(done, "does not fit", "saved shape (256, 32), expected (256, 64)")


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_a_key_a_newer_config_file_added_does_not_block_resuming(trained, tmp_path):
    """A run saved before the config file gained a model key resumes without --force
    (the key is at the file's value); overriding that key now is a change, refused."""
    workdir, _, data_dir = trained
    older = str(tmp_path / "older")
    shutil.copytree(workdir, older)
    saved = json.load(open(f"{older}/config.json"))
    del saved["model"]["padding"]  # as if written before configs had model.padding
    json.dump(saved, open(f"{older}/config.json", "w"))
    common = ["train", *SMOKE, "--workdir", older, data_dir, "--config.model.dense_features=32"]
    done = run_cli(*common, "--config.num_train_steps=6", "--config.model.padding=VALID")
    assert_one_line_error(done, "another experiment", "model.padding: (absent) -> VALID")
    done = run_cli(*common, "--config.num_train_steps=6")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Final test metrics after 6 steps" in done.stdout


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_a_rerun_without_a_complete_checkpoint_says_it_starts_over(trained, tmp_path):
    """Killed before its first checkpoint was whole: the rerun says it trains from step
    0 and each step is recorded once."""
    workdir, _, data_dir = trained
    attempt = tmp_path / "attempt"
    shutil.copytree(workdir, attempt)
    shutil.rmtree(attempt / "checkpoints")
    done = run_cli("train", *SMOKE, "--workdir", str(attempt), data_dir,
                   "--config.model.dense_features=32")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "No complete checkpoint" in done.stderr and "training from step 0" in done.stderr
    steps = [r["step"] for r in read_records(attempt) if "split" not in r]
    assert steps == sorted(set(steps))


def test_a_bug_keeps_its_traceback(tmp_path, digits_data_dir):
    (tmp_path / "buggy_experiment.py").write_text(
        "def make_experiment(settings):\n    return 1 / 0\n"
    )
    done = run_cli(
        "train", *SMOKE, "--workdir", str(tmp_path / "run"),
        f"--config.data_dir={digits_data_dir}", "--config.experiment=buggy_experiment",
        env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
    )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr
    assert "ZeroDivisionError" in done.stderr


def test_a_user_error_raised_in_the_library_is_one_line(tmp_path, digits_data_dir):
    """What decides is the error's type (a `replicator.errors.UserError`), not where it
    was raised: here the storage layer, called from an experiment outside the package."""
    (tmp_path / "denied_experiment.py").write_text(
        "from replicator import storage\n\n"
        "def make_experiment(settings):\n"
        "    def read():\n"
        "        raise PermissionError('403 Forbidden')\n"
        "    return storage.call('read', 'gs://no-access/weights', read)\n"
    )
    workdir = tmp_path / "run"
    done = run_cli(
        "train", *SMOKE, "--workdir", str(workdir), f"--config.data_dir={digits_data_dir}",
        "--config.experiment=denied_experiment",
        env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
    )  # fmt: skip
    assert_one_line_error(done, "cannot read gs://no-access/weights", "403 Forbidden")
    assert not workdir.exists()  # refused for its input: nothing left behind


# ---- eval uses the run's config


def test_eval_uses_the_runs_saved_config(trained):
    workdir, _, _ = trained  # trained with --config.model.dense_features=32
    main, child = pty.openpty()  # at a terminal: a line for a person, as train's
    output = []
    reader = threading.Thread(target=_drain, args=(main, output), daemon=True)
    reader.start()
    done = run_cli("eval", "--workdir", workdir, stdout=child)
    os.close(child)
    reader.join(timeout=10)
    assert done.returncode == 0, done.stderr[-3000:]
    line = r"test metrics of step 4: loss [\d.]+, accuracy [\d.]+ \(360 examples\)\r?\n"
    assert re.fullmatch(line, b"".join(output).decode()), output
    assert f"{workdir}/config.json" in done.stderr
    done = run_cli("eval", "--workdir", workdir)  # to a program: DESIGN's one JSON line
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["step"] == 4
    done = run_cli("eval", *SMOKE, "--workdir", workdir, "--config.eval_split=train", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["num_examples"] == 1437  # the override, on the run's config
    assert f"{workdir}/config.json with --config.eval_split=train" in done.stderr
    assert "model.dense_features" in done.stderr  # where the given file differs, not used


# ---- Corrupt checkpoints


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_a_garbage_checkpoint_is_skipped_set_aside_and_redone(tmp_path, trained):
    source, _, data_dir = trained
    workdir = tmp_path / "run"
    subprocess.run(["cp", "-r", source, str(workdir)], check=True)
    state = workdir / "checkpoints" / "4" / "state"
    garbage = {}
    for path in state.rglob("*"):
        if path.is_file():
            garbage[path.relative_to(state)] = os.urandom(max(path.stat().st_size, 16))
            path.write_bytes(garbage[path.relative_to(state)])

    done = run_cli("eval", "--workdir", str(workdir), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["step"] == 2
    (warning,) = [x for x in lines(done.stderr) if "step 4" in x]
    assert "unreadable" in warning and "restored step 2 instead" in warning
    assert state.is_dir()  # eval is read-only: nothing moved

    done = run_cli(
        "train", "--workdir", str(workdir), *SMOKE, data_dir, "--config.model.dense_features=32"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (warning,) = [x for x in lines(done.stderr) if "step 4" in x and "unreadable" in x]
    assert "checkpoints.corrupt/4" in warning and "restored step 2 instead" in warning
    assert "Resumed from step 2" in done.stderr
    assert "Final test metrics after 4 steps" in done.stdout
    kept = workdir / "checkpoints.corrupt" / "4" / "state"
    assert {p: (kept / p).read_bytes() for p in garbage} == garbage  # moved, not deleted
    steps = [r["step"] for r in read_records(workdir) if "split" not in r]
    assert steps == sorted(set(steps))
    done = run_cli("eval", "--workdir", str(workdir), "--json")
    assert json.loads(done.stdout)["step"] == 4 and "unreadable" not in done.stderr


def test_when_no_checkpoint_is_readable_both_commands_say_so_and_move_nothing(tmp_path, trained):
    source, _, data_dir = trained
    workdir = tmp_path / "run"
    subprocess.run(["cp", "-r", source, str(workdir)], check=True)
    for step in (2, 4):
        for path in (workdir / "checkpoints" / str(step)).rglob("*"):
            if path.is_file():
                path.write_bytes(os.urandom(max(path.stat().st_size, 16)))
    for args in (["eval", "--workdir", str(workdir)],
                 ["train", "--workdir", str(workdir), *SMOKE, data_dir,
                  "--config.model.dense_features=32"]):  # fmt: skip
        done = run_cli(*args)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        (error,) = [x for x in lines(done.stderr) if x.startswith("error: ")]
        assert "No readable checkpoint" in error and "steps [2, 4] are all unreadable" in error
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4"]
    assert not (workdir / "checkpoints.corrupt").exists()


# ---- A quiet console


def test_a_plain_run_shows_only_replicators_lines(trained):
    workdir, done, _ = trained  # tfds prepared the data set during this run
    assert "Final test metrics after 4 steps" in done.stdout
    shown = lines(done.stderr)
    assert shown[0].startswith("experiments.classify on Replicator(")
    assert any(x.startswith("step 4  test loss") for x in shown)
    assert shown[-2].startswith("wall time:") and "FLOP per step" in shown[-1]
    for noise in ("Downloading", "Generating", "Shuffling", "dataset_info", "W1", "WARNING"):
        assert noise not in done.stderr + done.stdout, noise
    log = open(os.path.join(workdir, "log.txt")).read()
    assert "Downloading and preparing dataset" in log  # hidden, not lost
    assert "step 4  test loss" in log


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_eval_is_quiet_and_verbose_shows_the_libraries(tmp_path, trained):
    workdir, _, _ = trained
    for verbose in (False, True):
        fresh = f"--config.data_dir={tmp_path / str(verbose)}"  # eval prepares the data there
        done = run_cli("eval", "--workdir", workdir, fresh, *["--verbose"] * verbose)
        assert done.returncode == 0, done.stderr[-3000:]
        prepared = "Downloading and preparing dataset" in done.stdout + done.stderr
        assert prepared == verbose
        if not verbose:  # no Orbax read-only notices, no tfds: only which config was used
            assert lines(done.stderr) == [
                f"eval: the run's config {workdir}/config.json with {fresh}"
            ]


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_progress_bar_on_a_terminal(tmp_path, digits_data_dir):
    main, child = pty.openpty()
    output = []
    reader = threading.Thread(target=_drain, args=(main, output), daemon=True)
    reader.start()
    done = run_cli(
        "train", *SMOKE, "--workdir", str(tmp_path), f"--config.data_dir={digits_data_dir}",
        stdout=child,
    )  # fmt: skip
    os.close(child)
    reader.join(timeout=10)
    terminal = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(output).decode(errors="replace"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"train .* 4/4 ", terminal), terminal  # rich's bar: "train ━━━ 4/4 ..."
    assert "Final test metrics after 4 steps" in terminal


def _drain(fd, output):
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            return
        if not chunk:
            return
        output.append(chunk)


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_more_mistakes_are_one_line(tmp_path, trained):
    workdir = str(tmp_path / "run")
    done = run_cli("train", "--config", "configs/digits_cnn.py:smok", "--workdir", workdir)
    assert_one_line_error(done, "unknown config mode 'smok'", "modes: smoke")
    done = run_cli("train", *SMOKE, "--workdir", workdir, "--config.diloco.inner_steps=5")
    assert_one_line_error(done, "config.diloco is None", """--config.diloco="{'inner_steps'""")
    done = run_cli("train", *SMOKE, "--workdir", workdir, "--config.mesh=data=2")
    assert_one_line_error(done, "write a Python literal", '--config.mesh="dict(data=-1)"')
    done = run_cli("train", "--config", "configs/lm_tiny.py:smoke", "--workdir", workdir,
                   "--config.model.max_len=64")  # fmt: skip
    assert_one_line_error(done, "windows hold 128 tokens, above config.model.max_len=64")
    assert not os.path.exists(workdir)
    open(workdir, "w").close()  # a file where the workdir should be
    assert_one_line_error(run_cli("train", *SMOKE, "--workdir", workdir), "is a file")
    # A damaged config.json in a run's workdir: one line from eval and from train.
    copy = str(tmp_path / "copy")
    shutil.copytree(trained[0], copy)
    with open(os.path.join(copy, "config.json"), "w") as f:
        f.write('{"exper')
    for args in (["eval", "--workdir", copy], ["train", *SMOKE, "--workdir", copy]):
        assert_one_line_error(run_cli(*args), "config.json cannot be read as a run's config")


def test_a_refused_command_writes_no_traceback_into_the_runs_log(trained, tmp_path):
    """Refused once it logs into the run (a step with no checkpoint, a batch that does not
    split): log.txt gains the header and the one line the terminal shows, no traceback."""
    copy = tmp_path / "copy"
    shutil.copytree(trained[0], copy)
    checkpoints = sorted(os.listdir(copy / "checkpoints"))
    log = (copy / "log.txt").read_text()
    for args, expected in [
        (["eval", "--workdir", str(copy), "--step", "999"], "No checkpoint for step 999"),
        (["train", *SMOKE, "--workdir", str(copy), trained[2], "--config.batch_size=33",
          "--config.model.dense_features=32"], "does not split evenly"),
    ]:  # fmt: skip
        done = run_cli(*args)  # (eval's line naming the config it read comes first)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert expected in lines(done.stderr)[-1]
        added = (copy / "log.txt").read_text()[len(log) :]
        assert "Traceback" not in added
        assert added.startswith("==== ") and lines(added)[-1] == lines(done.stderr)[-1]
        log += added
    assert sorted(os.listdir(copy / "checkpoints")) == checkpoints


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_eval_follow_prints_one_json_line_per_result(trained):
    workdir, _, data_dir = trained
    done = run_cli(
        "eval", "--workdir", workdir, data_dir, "--follow", "--follow_timeout=2", "--json"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in lines(done.stdout)]  # nothing but JSON lines
    steps = sorted(int(name) for name in os.listdir(os.path.join(workdir, "checkpoints")))
    assert [r["step"] for r in results] == steps


def test_none_on_the_command_line_is_none_for_a_key_that_allows_it():
    from replicator.trainer import config as config_lib
    from tests.helpers.configs import digits_config

    assert config_lib.validate(digits_config(precision="None")).precision is None
    with pytest.raises(config_lib.ConfigError, match="'batch_size' is None"):
        config_lib.validate(digits_config(batch_size=None))
