"""Config files as users get them wrong, and the dict and tuple overrides the docs
print. A bad config file is one line on stderr (exit status 2, no traceback) that
names the file and what is wrong, and leaves an existing run's workdir as it was;
every dict or tuple override shown in the guide, pods.md, the README or a config's
docstring parses to a dict or tuple exactly as printed."""

import dataclasses
import glob
import os
import re
import shlex
import sys

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from replicator.errors import ConfigError, UsageError
from replicator.trainer import config as config_lib
from replicator.trainer import config_files
from tests.helpers.cli import ROOT, SMOKE, assert_one_line_error, run_cli

# name -> (the file's source, what its one line says); `NAME.py` stands for its path.
BAD_FILES = {
    "returns_a_list": (
        "def get_config():\n    return [1, 2]\n",
        ["returns_a_list.py", "get_config() returned a 'list' object", "ml_collections.ConfigDict"],
    ),
    "no_get_config": ("CONFIG = {'batch_size': 8}\n", ["no_get_config.py", "no get_config()"]),
    "syntax_error": (
        "def get_config(:\n    return {}\n",
        ["is not valid Python", "SyntaxError at", "syntax_error.py:1"],
    ),
    "import_error": (
        "import no_such_module_xyz\n\n\ndef get_config():\n    return {}\n",
        ["failed to import", "ModuleNotFoundError at", "import_error.py:1", "no_such_module_xyz"],
    ),
    "raises": (
        "def get_config():\n    raise ValueError('no size 7')\n",
        ["get_config() raised ValueError at", "raises.py:2 in get_config", "no size 7"],
    ),
    "needs_an_argument": (
        "def get_config(size):\n    return {}\n",
        ["get_config(size) needs an argument", "needs_an_argument.py:VALUE"],
    ),
    "returns_none": (
        "def get_config():\n    config = {}\n",
        ["returns_none.py", "get_config() returned None", "no return statement"],
    ),
    "name_error": (
        "import ml_collections\n\n\ndef get_config():\n"
        "    c = ml_collections.ConfigDict()\n    c.batch_size = batch\n    return c\n",
        ["NameError at", "name_error.py:6 in get_config", "name 'batch' is not defined", "--debug"],
    ),
}


@pytest.fixture()
def bad_files(tmp_path):
    folder = tmp_path / "configs"
    folder.mkdir()
    for name, (source, _) in BAD_FILES.items():
        (folder / f"{name}.py").write_text(source)
    return folder


@pytest.fixture()
def existing_run(tmp_path):
    """A workdir as a run leaves it: log.txt, config.json, checkpoints. A config file's
    mistake is found while the flags are read, before the workdir is looked at."""
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "4" / "state").mkdir(parents=True)
    (workdir / "checkpoints" / "4" / "state" / "array").write_bytes(os.urandom(64))
    (workdir / "log.txt").write_text("==== earlier python -m replicator train ...\nstep 4\n")
    (workdir / "config.json").write_text("{}")
    return workdir


def snapshot(folder):
    return {
        os.path.relpath(path, folder): (open(path, "rb").read(), os.stat(path).st_mtime_ns)
        for path in glob.glob(f"{folder}/**", recursive=True)
        if os.path.isfile(path)
    }


# ---- Bad config files


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_a_bad_config_file_is_one_line_and_touches_no_run(name, bad_files, existing_run):
    before = snapshot(existing_run)
    done = run_cli(
        "train", "--config", str(bad_files / f"{name}.py"), "--workdir", str(existing_run)
    )
    assert_one_line_error(done, "config file", *BAD_FILES[name][1])
    assert snapshot(existing_run) == before  # log.txt and the checkpoints as they were


@pytest.mark.parametrize(
    "config, expected",
    [
        ("{folder}/missing.py", ["config file '{folder}/missing.py' does not exist"]),
        ("{folder}", ["config file '{folder}' is a directory"]),
        ("{folder}/raises.py:smoke", ["raises.py' has no modes", "drop ':smoke'"]),
    ],
)
def test_a_config_path_or_mode_that_cannot_be_used_is_one_line(
    config, expected, bad_files, existing_run
):
    before = snapshot(existing_run)
    config = config.format(folder=bad_files)
    done = run_cli("train", "--config", config, "--workdir", str(existing_run))
    assert_one_line_error(done, *[text.format(folder=bad_files) for text in expected])
    assert snapshot(existing_run) == before


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_eval_and_help_say_the_same_line(bad_files, existing_run):
    config = str(bad_files / "returns_a_list.py")
    for args in (["eval", "--config", config], ["train", "--config", config, "--help"]):
        assert_one_line_error(run_cli(*args, "--workdir", str(existing_run)), "a 'list' object")


def test_the_users_traceback_is_there_with_debug(bad_files, tmp_path):
    done = run_cli("train", "--config", str(bad_files / "name_error.py"),
                   "--workdir", str(tmp_path / "run"), "--debug")  # fmt: skip
    assert done.returncode == 2
    assert f'File "{bad_files / "name_error.py"}", line 6, in get_config' in done.stderr
    assert "c.batch_size = batch" in done.stderr  # the user's own line, from their file
    assert done.stderr.strip().splitlines()[-1].startswith("error: config file")


def test_a_plain_dict_is_a_config(tmp_path):
    (tmp_path / "as_dict.py").write_text(
        "import os\n\nfrom replicator.trainer.config import config_beside\n\n\n"
        "def get_config(mode=''):\n"
        f"    c = config_beside({os.path.join(ROOT, 'configs', 'x.py')!r}, 'digits_cnn.py', mode)\n"
        "    return c.to_dict()\n"
    )
    config = config_files.read_config_file(str(tmp_path / "as_dict.py"), "smoke")
    assert isinstance(config, ml_collections.ConfigDict) and config.is_locked
    assert config_lib.validate(config).num_train_steps == 4
    frozen = tmp_path / "frozen.py"
    frozen.write_text(
        "import ml_collections\n\n\ndef get_config():\n"
        "    return ml_collections.FrozenConfigDict({'mesh': {'data': 2}})\n"
    )
    assert config_files.read_config_file(str(frozen)).mesh.data == 2


# ---- Dict and tuple overrides


def apply_overrides(config_file, *args):
    """``config_file`` with the command line's ``--config.KEY=VALUE`` parsed as the CLI
    parses them (ml_collections' parsers, after `write_overrides_as_literals`)."""
    path, _, mode = config_file.partition(":")
    argv = ["replicator", *config_files.write_overrides_as_literals(list(args))]
    values = flags.FlagValues()
    config = config_files.read_config_file(os.path.join(ROOT, path), *([mode] if mode else []))
    config_flags.DEFINE_config_dict("config", config, flag_values=values, sys_argv=argv)
    values(argv)
    return values.config


def printed_overrides():
    """``(file, key, value)`` of each quoted ``--config.KEY="..."`` in the docs and configs,
    the value as the shell passes it (a literal that wraps a line is joined)."""
    found = []
    for name in ["docs/guide.md", "docs/pods.md", "README.md", *sorted(glob.glob("configs/*.py"))]:
        text = open(os.path.join(ROOT, name)).read()
        for key, quoted in re.findall(r"""--config\.([\w.]+)=("[^"]*"|'[^']*')""", text):
            found.append((name, key, shlex.split(re.sub(r"\s+", " ", quoted))[0]))
    return found


def test_every_dict_and_tuple_override_the_docs_print_parses(monkeypatch):
    monkeypatch.chdir(ROOT)
    shown = [
        (name, key, value)
        for name, key, value in printed_overrides()
        if dict in config_lib.SCHEMA.get(key, ((),))[0]
        or tuple in config_lib.SCHEMA.get(key, ((),))[0]
    ]
    seen = {(key, value.split("(")[0] == "dict") for _, key, value in shown}
    assert {("optimizer_args", True), ("mesh", True), ("dcn_mesh", False)} <= seen
    assert {"writers", "init_from_rules", "lr_mults"} <= {key for key, _ in seen}
    for name, key, value in shown:
        config_file = name if name.startswith("configs/") else SMOKE[1]
        config = apply_overrides(config_file, f"--config.{key}={value}")
        parsed = config[key]
        kind = (
            (dict, ml_collections.ConfigDict)
            if dict in config_lib.SCHEMA[key][0]
            else (tuple, list)
        )
        assert isinstance(parsed, kind), (name, key, value, parsed)
        if "init_from" not in key:  # init_from_rules wants an init_from too
            config_lib.validate(config)


def test_dict_calls_and_literals_give_the_same_config():
    as_call = apply_overrides(SMOKE[1], "--config.optimizer_args=dict(b1=0.9, b2=0.95)",
                              "--config.mesh=dict(data=2, fsdp=4)",
                              "--config.diloco=dict(inner_steps=20, axis='data')")  # fmt: skip
    as_literal = apply_overrides(SMOKE[1], "--config.optimizer_args={'b1': 0.9, 'b2': 0.95}",
                                 "--config.mesh={'data': 2, 'fsdp': 4}",
                                 "--config.diloco={'inner_steps': 20, 'axis': 'data'}")  # fmt: skip
    assert as_call.to_dict() == as_literal.to_dict()
    assert as_call.optimizer_args == {"b1": 0.9, "b2": 0.95}
    assert as_call.mesh.to_dict() == {"data": 2, "fsdp": 4}
    regex = apply_overrides(
        SMOKE[1], "--config.freeze=^(?!Dense_1/)", "--config.model.padding=SAME"
    )
    assert regex.freeze == "^(?!Dense_1/)"  # a str key's value is left as written


@pytest.mark.parametrize(
    "arg, expected",
    [
        ("--config.optimizer_args=b1=0.9", ["is not a dict", '"dict(b2=0.95)"', "{'b2': 0.95}"]),
        ("--config.optimizer_args={b1: 0.9}", ["is not a dict"]),
        ("--config.mesh=dict(data=n)", ["is not a dict", '--config.mesh="dict(data=-1)"']),
        ("--config.init_from_rules=^params/", ["is not a tuple", "ends with a comma"]),
        ("--config.lr_mults=Dense_1", ["is not a tuple", 'lr_mults="((']),
        ("--config.diloco=__import__('os').system('touch pwned')", ["is not a dict"]),
    ],
)
def test_an_override_that_is_no_literal_shows_the_accepted_forms(
    arg, expected, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as raised:
        config_files.write_overrides_as_literals(["train", arg])
    for text in expected:
        assert text in str(raised.value)
    assert not os.path.exists("pwned")  # read, never evaluated


GUIDES_OVERRIDES = [
    "--config.optimizer_args=dict(b1=0.9, b2=0.95)",
    "--config.mesh=dict(data=2)",
    "--config.freeze=^(?!Dense_1/)",
]


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_the_cli_reads_the_guides_dict_overrides(tmp_path):
    done = run_cli("train", *SMOKE, "--workdir", str(tmp_path / "run"), *GUIDES_OVERRIDES, "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^  optimizer_args +None +\{'b1': 0.9, 'b2': 0.95\}", done.stdout, re.M)
    assert re.search(r"^  mesh +\{'data': -1\} +\{'data': 2\} ", done.stdout, re.M)
    done = run_cli("train", *SMOKE, "--workdir", str(tmp_path / "run"),
                   "--config.optimizer_args=b1=0.9")  # fmt: skip
    assert_one_line_error(done, "is not a dict", "dict(b2=0.95)")


@pytest.mark.slow  # 10-15 s; test_the_cli_reads_the_guides_dict_overrides holds the parsing
def test_the_cli_trains_with_the_guides_dict_overrides(tmp_path, digits_data_dir):
    workdir = tmp_path / "run"
    done = run_cli("train", *SMOKE, "--workdir", str(workdir),
                   f"--config.data_dir={digits_data_dir}", *GUIDES_OVERRIDES)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "adam(b1=0.9, b2=0.95)" in done.stderr
    saved = config_lib.read_saved(str(workdir))
    assert saved["optimizer_args"] == {"b1": 0.9, "b2": 0.95}
    assert saved["mesh"] == {"data": 2}


def test_a_key_none_in_a_plain_config_is_one_line(tmp_path):
    (tmp_path / "bare.py").write_text("def get_config():\n    return {'optimizer_args': None}\n")
    done = run_cli("train", "--config", str(tmp_path / "bare.py"), "--workdir",
                   str(tmp_path / "run"), "--config.optimizer_args={'b1': 0.9}")  # fmt: skip
    assert_one_line_error(done, "config.optimizer_args is None in the config file", "base_config()")
    with pytest.raises(ConfigError, match="does not exist"):
        config_files.read_config_file(str(tmp_path / "none.py"))


# ---- The experiment's own keys (`replicator.trainer.ConfigKeys`)

LM_OPTIONS = ("tokenizer", "pack_documents", "remat_policy", "pipeline_microbatches",
              "pipeline_repeats", "context_strategy", "context_load_balance", "objective",
              "dpo_beta", "dpo_label_smoothing", "simpo_gamma")  # fmt: skip


def test_the_lms_keys_are_the_lms_and_every_model_field_is_declared():
    from experiments.lm import CONFIG_KEYS, Transformer
    from experiments.lm.config import NOT_MODEL_KEYS

    assert not set(LM_OPTIONS) & set(config_lib.SCHEMA)  # the trainer knows none of them
    assert set(CONFIG_KEYS.options) == set(LM_OPTIONS)
    for name in ("experiments.classify", "experiments.gan"):
        keys = config_lib.experiment_keys(name)
        assert not keys.options and not keys.mesh_axes and keys.model
    # A Transformer field is a model key (its default the field's), an option, or neither
    # by name: a new field cannot miss the table that the command line and --help read.
    fields = {f.name: f.default for f in dataclasses.fields(Transformer)}
    fields = {k: v for k, v in fields.items() if k not in ("parent", "name", *NOT_MODEL_KEYS)}
    data_and_objective = {
        "tokenizer",
        "pack_documents",
        "objective",
        "dpo_beta",
        "dpo_label_smoothing",
        "simpo_gamma",
    }  # the task's, not the model's
    assert set(fields) == set(CONFIG_KEYS.model) | set(LM_OPTIONS) - data_and_objective
    assert all(CONFIG_KEYS.model[k][1] == fields[k] for k in CONFIG_KEYS.model)


def lm_smoke(*args):
    return apply_overrides("configs/lm_tiny.py:smoke", *args)


# (config file, overrides, what the one problem says): each found by `validate`, before
# anything is created, whatever the devices (the mesh's sizes as the config gives them).
CONFIG_MISTAKES = [
    ("lm", ["--config.model.num_experts=4", "--config.model.expert_capacity_factor=0.0"],
     "expert_capacity_factor=0.0 must be > 0"),
    ("lm", ["--config.model.num_experts=4", "--config.model.expert_capacity_factor=-1.0"],
     "expert_capacity_factor=-1.0 must be > 0"),
    ("lm", ["--config.model.num_experts=3", "--config.mesh.expert=2"],
     "3 experts do not split over the 2 devices of mesh axis 'expert'"),
    ("lm", ["--config.model.num_experts=4", "--config.mesh.stage=2"],
     r"num_experts=4 with a pipeline \(mesh axis 'stage' of 2\)"),
    ("lm", ["--config.mesh.stage=4"], "pipeline: 1 layers do not split over 4 stages x 1 repeats"),
    ("lm", ["--config.mesh.stage=2", "--config.model.num_layers=2", "--config.pipeline_repeats=2"],
     "pipeline: 2 layers do not split over 2 stages x 2 repeats"),
    ("lm", ["--config.mesh.stage=2", "--config.model.num_layers=2",
            "--config.pipeline_microbatches=1"], "pipeline_microbatches=1 leaves stages"),
    ("lm", ["--config.pipeline_repeats=0"], "pipeline_repeats=0 and pipeline_microbatches=None"),
    ("lm", ["--config.pipeline_microbatches=0"], "must be >= 1"),
    ("lm", ["--config.mesh.stage=2", "--config.model.num_layers=2",
            "--config.model.dropout_rate=0.1"], "does not run dropout"),
    ("lm", ["--config.remat_policy=minimum"], "remat_policy='minimum' is not a policy"),
    ("lm", ["--config.context_strategy=rign"], "context_strategy='rign'"),
    ("lm", ["--config.model.num_heads=3"], "does not divide into num_heads=3"),
    ("lm", ["--config.model.num_experts=four"], "could not convert|invalid literal"),
    ("digits_cnn", ["--config.mesh={'stage': 2, 'data': -1}"],
     "'mesh' has axis 'stage' of size 2, which experiments.classify does not use"),
    ("digits_vit", ["--config.model.patch_size=3"], "patch_size=3 does not divide image_size=8"),
    ("digits_cnn", ["--config.model.arch=vgg"], "arch='vgg' is not one of"),
    ("gan_digits", ["--config.model.noise=pixel"], "noise='pixel' is not one of"),
    ("gan_digits", ["--config.model={'noise_dims': 8}"], r"'model.noise_dims' \(did you mean"),
]  # fmt: skip


@pytest.mark.parametrize("name, args, expected", CONFIG_MISTAKES, ids=lambda x: str(x)[:60])
def test_each_config_mistake_is_one_problem_found_before_anything_runs(name, args, expected):
    path = "configs/lm_tiny.py:smoke" if name == "lm" else f"configs/{name}.py:smoke"
    with pytest.raises((ConfigError, flags.Error)) as raised:
        config_lib.validate(apply_overrides(path, *args))
    message = str(raised.value)
    assert re.search(expected, message), message
    assert message.count("\n  - ") <= 1  # the one mistake, said once


def test_a_key_of_another_experiment_says_whose_it_is():
    config = apply_overrides("configs/digits_cnn.py:smoke")
    with config.unlocked():
        config.remat_policy = "full"
    with pytest.raises(ConfigError, match=r"unknown key 'remat_policy' \(experiments.classify "
                       r"has no such key; experiments.lm has\)"):  # fmt: skip
        config_lib.validate(config)


def test_nested_keys_of_every_lm_config_are_overridden(monkeypatch):
    config = lm_smoke("--config.model.num_experts=4", "--config.mesh.expert=2",
                      "--config.mesh.fsdp=4")  # fmt: skip
    assert (config.model.num_experts, config.mesh.expert, config.mesh.stage) == (4, 2, 1)
    lm_tiny = os.path.join(ROOT, "configs/lm_tiny.py:smoke")
    monkeypatch.setattr(sys, "argv", ["train", "--config", lm_tiny])  # as the CLI sets it
    argv = config_files.take_nulled(["train", "--config.model.mlp_dim=None", "--config.seed=1"])
    assert argv == ["train", "--config.seed=1"]
    config_files._set_nulled(config)
    assert config.model.mlp_dim is None
    assert config_lib.validate(config).model.to_dict()["num_experts"] == 4
    config_files.take_nulled(["train", "--config.model.mlp_dims=None"])
    with pytest.raises(UsageError, match=r"unknown config key 'model.mlp_dims' \(did you mean"):
        config_files._set_nulled(config)
    config_files.take_nulled([])


def test_an_old_runs_saved_config_keeps_working():
    """A run saved before the LM's keys were its own holds them at their defaults,
    whatever its experiment: eval reads it as the classifiers' config it is."""
    saved = config_lib.validate(apply_overrides(SMOKE[1])).to_dict()
    saved.update(tokenizer="bytes", pack_documents=False, remat_policy=None,
                 pipeline_microbatches=None, pipeline_repeats=1, context_strategy="gather",
                 context_load_balance=False)  # fmt: skip
    config = config_lib.from_saved(saved)
    assert "tokenizer" not in config
    assert config_lib.validate(config).model.dense_features == 64
    lm = config_lib.from_saved(config_lib.validate(lm_smoke()).to_dict())
    lm.model.num_experts = 4  # a saved None keeps its type for an override
    assert lm.pipeline_microbatches is None and lm.model.num_experts == 4


# ---- The same mistakes on the command line: one line, exit 2, nothing written


def test_an_lm_mistake_on_the_command_line_touches_no_workdir(existing_run):
    """Found by the config's validation, before the workdir is looked at: a run's
    workdir keeps even its log.txt as it was (a new one is never made: the tests above)."""
    before = snapshot(existing_run)
    done = run_cli("train", "--config", "configs/lm_tiny.py:smoke", "--workdir",
                   str(existing_run), "--config.model.num_experts=3", "--config.mesh.expert=2",
                   "--config.mesh.fsdp=4")  # fmt: skip
    assert_one_line_error(done, "3 experts do not split over the 2 devices")
    assert snapshot(existing_run) == before


@pytest.mark.parametrize(
    "config, arg, expected",
    [
        (SMOKE[1], "--config.tokenizer=x", "'tokenizer': experiments.classify has no key "
         "'tokenizer'; experiments.lm has"),
        (SMOKE[1], "--config.mesh.stage=2", "'mesh.stage': experiments.classify has no mesh "
         "axis 'stage'; experiments.lm has"),
        ("configs/gan_digits.py:smoke", "--config.remat_policy=full",
         "'remat_policy': experiments.gan has no key 'remat_policy'; experiments.lm has"),
        ("configs/lm_tiny.py:smoke", "--config.model.num_expert=4",
         "'model.num_expert' (did you mean 'model.num_experts'?)"),
        ("configs/llama_tiny.py:smoke", "--config.mesh.stag=2", "'mesh.stag' (did you mean "
         "'mesh.stage'?)"),
    ],
)  # fmt: skip
def test_an_unknown_key_says_where_it_belongs(config, arg, expected, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises((AttributeError, KeyError, flags.Error)) as raised:
        apply_overrides(config, arg)
    error = config_files.flag_error(raised.value, ["train", "--config", config, arg])
    assert str(error) == f"unknown config key {expected}"


def test_an_unknown_key_on_the_command_line_is_one_line(tmp_path):
    workdir = tmp_path / "run"
    done = run_cli("train", *SMOKE, "--workdir", str(workdir), "--config.pack_documents=True")
    assert_one_line_error(done, "experiments.classify has no key 'pack_documents'; experiments.lm")
    assert not workdir.exists()


def test_a_sequence_the_context_axis_cannot_split_is_one_line_before_the_workdir(tmp_path):
    """Known once the data's windows are: the step's tracing finds it, before anything
    is written."""
    import experiments.lm  # noqa: F401  (registers the text_files builder)
    from replicator.trainer import data

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    dataset, data_dir = f"text_files/block_size=60,files={text}", str(tmp_path / "tfds")
    data.load_data_source(dataset, "train", data_dir=data_dir)  # built: no progress bar
    workdir = tmp_path / "run"
    done = run_cli("train", "--config", "configs/lm_tiny.py:smoke", "--workdir", str(workdir),
                   f"--config.dataset={dataset}", f"--config.data_dir={data_dir}",
                   "--config.model.max_len=60", "--config.mesh={'context': 8}",
                   devices=8)  # fmt: skip
    assert_one_line_error(done, "60 tokens does not split into 8 equal chunks")
    assert not workdir.exists()
