"""Command line: ``python -m replicator {train,eval,plot,launch} ...``.

``train`` and ``eval`` take an ml_collections config file (``--config``) whose
keys can be overridden with ``--config.key=value`` (type-checked); ``eval``
starts from the run's own ``WORKDIR/config.json`` instead when there is one.
``launch`` is `replicator.runtime.launch`.

What a person sees:

* ``--help`` at every level: the subcommands; a subcommand's flags and, for
  ``train``/``eval``, every config key with its default and meaning (from
  `replicator.trainer.config.describe_keys`, the one table), plus the given
  config's values.
* A mistake in the input (a flag, the config, the workdir, the mesh, the
  batch) ends in one line, ``error: ...``, and exit status 2; ``--debug`` or
  ``REPLICATOR_DEBUG=1`` adds the traceback. Anything else is a bug and keeps
  its traceback (exit status 1).
* A quiet console: replicator's own lines (progress bar, evals, summary,
  warnings). What the libraries underneath print (tfds, Orbax, absl, JAX, C++
  logs) goes to ``WORKDIR/log.txt`` instead, unless ``--verbose``.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import sys
import textwrap
import traceback
from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

from replicator import storage
from replicator.trainer.console import Console

FLAGS = flags.FLAGS
USAGE_ERROR = 2  # exit status of a mistake in the input (1: a bug, with its traceback)

COMMANDS = {
    "train": "train a config's experiment in WORKDIR, resuming from its newest checkpoint",
    "eval": "evaluate a checkpoint of WORKDIR on the devices there are now (one JSON line)",
    "plot": "draw WORKDIR's metrics as PNG files in WORKDIR/plots/",
    "launch": "run a command as every process of a multi-process run: local, tpu or slurm",
}

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Experiment config file, e.g. configs/digits_cnn.py[:smoke]; eval: the run's "
    "WORKDIR/config.json is used when it exists.",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, logs and checkpoints.")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint step to evaluate (default: latest).")
_QUIET = flags.DEFINE_bool("quiet", False, "No progress bar.")
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Show what tfds, Orbax, absl and JAX print (else only in WORKDIR/log.txt)."
)
_DEBUG = flags.DEFINE_bool(
    "debug", False, "Show the traceback of an input error too (or REPLICATOR_DEBUG=1)."
)
_FORCE = flags.DEFINE_bool(
    "force", False, "Train in a WORKDIR whose config.json names another experiment or model."
)
_STRICT = flags.DEFINE_bool(
    "strict", False, "Fail on an unreadable checkpoint instead of using the previous one."
)
_FOLLOW = flags.DEFINE_bool(
    "follow", False, "Evaluate every new checkpoint as training writes it (a sidecar)."
)
_FOLLOW_TIMEOUT = flags.DEFINE_float(
    "follow_timeout", None, "With --follow: stop after this many seconds without a new checkpoint."
)
_INIT_TIMEOUT = flags.DEFINE_float(
    "init_timeout", 300.0, "Multi-process runs: seconds to wait for every process to arrive."
)
_COMPILE_CACHE = flags.DEFINE_string(
    "compile_cache",
    os.path.expanduser("~/.cache/replicator/jax"),
    "JAX's persistent compilation cache ('' to disable): a second run of the same "
    "config starts in a fraction of the compile time.",
)
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices",
    None,
    "Split this host's CPU into N JAX devices (a CPU-only stand-in for a multi-device "
    "host). Default: JAX's own device count.",
)

_COMMON = (_VERBOSE, _DEBUG, _CPU_DEVICES, _COMPILE_CACHE, _INIT_TIMEOUT)
_FLAGS_OF = {
    "train": (_CONFIG, _WORKDIR, _QUIET, _STRICT, _FORCE, *_COMMON),
    "eval": (_CONFIG, _WORKDIR, _STEP, _STRICT, _FOLLOW, _FOLLOW_TIMEOUT, *_COMMON),
}
_SYNOPSIS = {
    "train": "train --config FILE[:MODE] --workdir DIR [--config.KEY=VALUE ...] [flags]",
    "eval": "eval --workdir DIR [--config FILE[:MODE]] [--config.KEY=VALUE ...] [flags]",
    "plot": "plot WORKDIR",
}
_HELP = ("-h", "--help", "-help", "--helpshort", "help")
_CONFIG_FILE_GIVEN = True  # False when eval made WORKDIR/config.json the --config flag


class UsageError(Exception):
    """A mistake in what the user asked for: reported in one line, exit status 2."""


# ---------------------------------------------------------------- entry point


def run(argv: Sequence[str] | None = None) -> None:
    """``python -m replicator``: dispatches to a subcommand."""
    argv = list(sys.argv if argv is None else argv)
    command = argv[1] if len(argv) > 1 else None
    if command == "launch":
        from replicator.runtime import launch

        sys.exit(launch.main(argv[2:]))
    if command is None or command in _HELP:
        print(_usage())
        sys.exit(0 if command else USAGE_ERROR)
    try:
        if command not in COMMANDS:
            close = difflib.get_close_matches(command, COMMANDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(
                f"unknown command {command!r}{hint}; `python -m replicator --help` lists them"
            )
        own_args = argv[2 : argv.index("--")] if "--" in argv else argv[2:]
        if command == "eval":
            _use_the_runs_config(argv)
        if any(arg in _HELP for arg in own_args):
            _load_flags_for_help(argv)
            print(_command_help(command))
            sys.exit(0)
        _check_config_file(argv)
    except (UsageError, ValueError, OSError) as e:  # the run's config.json, its bucket
        if not _is_user_error(e):
            raise
        _exit_with(e, debug=_debug_requested(argv))
    sys.argv = argv  # ml_collections reads the config overrides from sys.argv
    app.run(main_or_exit, argv=argv, flags_parser=_parse_flags)


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return FLAGS(argv)
    except Exception as e:  # noqa: BLE001  (the config file's own errors land here too)
        _exit_with(_flag_error(e), debug=_debug_requested(argv), cause=e)


def main_or_exit(argv: list[str]) -> None:
    """`main`, with input errors as one line (exit status 2) and bugs with their traceback.

    In a multi-process run an error exits at once: a normal exit waits at JAX's
    shutdown barrier for the other processes, which are stuck in a collective
    waiting for this one, until a 5-minute timeout; exiting at once lets the
    launcher see the failure and stop the others.
    """
    console = Console(verbose=_VERBOSE.value or argv[1] == "plot")
    try:
        main(argv, console)
        console.close()
        return
    except SystemExit:
        console.close()
        raise
    except KeyboardInterrupt as e:  # before the training loop (which saves and stops)
        console.report(e, summary="interrupted")
        code = 130
    except BaseException as e:
        user_error = _is_user_error(e)
        one_line = user_error and not _debug_requested(sys.argv)
        console.report(e, summary=f"error: {_one_line(str(e))}" if one_line else None)
        code = USAGE_ERROR if user_error else 1
        if user_error:
            console.discard_new_workdir()
    try:
        console.close()  # a log in a bucket is uploaded before the process ends
    except OSError as e:
        console.err.write(f"warning: the log could not be uploaded: {e}\n")
    if _process_count() > 1:
        os._exit(code)
    sys.exit(code)


def main(argv: list[str], console: Console) -> None:
    """Runs ``train``, ``eval`` or ``plot`` with the parsed flags."""
    command = argv[1]
    if command == "plot":
        _plot(argv)
        return
    if len(argv) > 2:
        raise UsageError(f"unexpected arguments {argv[2:]}; flags are written --name=value")
    for flag in (_CONFIG, _WORKDIR):
        if flag.value is None:
            raise UsageError(f"--{flag.name} is required; see `python -m replicator {command} -h`")
    import jax

    if _CPU_DEVICES.value:
        jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
    if _COMPILE_CACHE.value:
        jax.config.update("jax_compilation_cache_dir", _COMPILE_CACHE.value)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    from replicator.runtime.processes import detect_process_group, initialize_distributed

    initialize_distributed(detect_process_group(), timeout_s=_INIT_TIMEOUT.value)
    chief = jax.process_index() == 0  # only process 0 prints results
    console.set_process(jax.process_index())
    from replicator.trainer import config as config_lib

    workdir = _WORKDIR.value
    if storage.is_remote(workdir):  # a missing bucket or no answer: one line, before anything
        storage.check_writable(workdir) if command == "train" else storage.check_bucket(workdir)
    elif os.path.exists(workdir) and not os.path.isdir(workdir):
        raise UsageError(f"--workdir {workdir} is a file, not a directory")
    config = _config_for(command, workdir)
    validated = config_lib.validate(config)  # every mistake in it, before anything is written
    if command == "train":
        _check_workdir(validated, workdir)
    console.log_to(workdir, jax.process_index(), " ".join(sys.argv[1:]), create=command == "train")
    if command == "train":
        _train(config, workdir, console, chief)
    else:
        _eval(config, workdir, console, chief)


def _train(config, workdir: str, console: Console, chief: bool) -> None:
    from replicator import trainer
    from replicator.trainer.preemption import Preempted

    try:
        result = trainer.train_and_evaluate(
            config, workdir, quiet=_QUIET.value, strict=_STRICT.value
        )
    except Preempted as e:
        if chief:
            console.print(e)
        return
    if chief:
        shown = ", ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, float))
        console.print(
            f"Final {config.get('eval_split', 'test')} metrics after {result['step']} steps: "
            f"{shown} ({result['num_examples']} examples)"
        )


def _eval(config, workdir: str, console: Console, chief: bool) -> None:
    from replicator import trainer

    if _FOLLOW.value:
        for result in trainer.follow(config, workdir, timeout_s=_FOLLOW_TIMEOUT.value):
            if chief:
                console.print(json.dumps(result))
        return
    result = trainer.evaluate(config, workdir, step=_STEP.value, strict=_STRICT.value)
    if chief:
        console.print(json.dumps(result))


def _plot(argv: list[str]) -> None:
    from replicator.trainer.plot import plot_metrics

    workdir = argv[2] if len(argv) == 3 else _WORKDIR.value
    if workdir is None or len(argv) > 3:
        raise UsageError(f"usage: python -m replicator {_SYNOPSIS['plot']}")
    if not storage.isfile(storage.join(workdir, "metrics.jsonl")):
        raise UsageError(f"{workdir} has no metrics.jsonl to plot")
    for path in plot_metrics(workdir):
        print(path)


# ---------------------------------------------------------------- configs


def _config_for(command: str, workdir: str):
    """train: the config file with its overrides. eval: the run's saved config with the
    command line's overrides on top (the file's only when the run saved none)."""
    config = FLAGS.config
    if command != "eval" or not _CONFIG_FILE_GIVEN:
        if command == "eval":
            logging.getLogger("replicator").info(
                "eval: the run's config %s%s", _saved_path(workdir), _overrides_text()
            )
        return config
    from replicator.trainer.config import config_differences
    from replicator.trainer.evaluator import run_config

    saved = run_config(workdir)
    log = logging.getLogger("replicator")
    file = FLAGS["config"].config_filename
    if saved is None:
        log.info("eval: the config %s (%s has none saved)%s", file, workdir, _overrides_text())
        return config
    overrides = config_flags.get_override_values(FLAGS["config"])
    saved.lock()  # an override names a key of the run's config
    try:
        saved.update_from_flattened_dict(overrides)
    except (TypeError, KeyError, AttributeError) as e:
        raise UsageError(f"cannot apply{_overrides_text()} to the run's config: {e}") from e
    ignored = [
        d.split(":")[0]
        for d in config_differences(saved.to_dict(), config.to_dict())
        if d.split(":")[0] not in overrides
    ]
    log.info(
        "eval: the run's config %s%s%s",
        _saved_path(workdir),
        _overrides_text(),
        f"; {file} differs in {', '.join(ignored)}, not used" if ignored else "",
    )
    return saved


def _use_the_runs_config(argv: list[str]) -> None:
    """eval without --config: makes the flag the run's saved config, so that
    ``--config.key=value`` overrides apply to it, type-checked."""
    global _CONFIG_FILE_GIVEN
    workdir = _argv_value(argv, "workdir")
    if _argv_value(argv, "config") is not None or workdir is None:
        return
    from replicator.trainer.evaluator import run_config

    storage.check_bucket(workdir)  # "no such bucket" rather than "no config.json"
    saved = run_config(workdir)
    if saved is None:
        if any(arg in _HELP for arg in argv):
            return
        raise UsageError(
            f"{_saved_path(workdir)} does not exist (not a training run's workdir?); "
            "pass --config FILE"
        )
    help_text = FLAGS["config"].help
    delattr(FLAGS, "config")
    sys.argv = [a for a in argv if a not in _HELP]
    try:  # the overrides are parsed here, against the saved config's keys and types
        config_flags.DEFINE_config_dict("config", saved, help_text, lock_config=True)
    except Exception as e:  # noqa: BLE001
        raise _flag_error(e) from e
    _CONFIG_FILE_GIVEN = False


def _check_config_file(argv: list[str]) -> None:
    value = _argv_value(argv, "config")
    if value is not None and _CONFIG_FILE_GIVEN:
        path = value.split(":", 1)[0]
        if not os.path.isfile(path):
            raise UsageError(f"config file {path!r} does not exist")


def _check_workdir(config, workdir: str) -> None:
    """Refuses a workdir whose run trained another experiment or model (unless --force)."""
    from replicator.trainer.config import config_differences, read_saved

    saved = read_saved(workdir)
    if saved is None or _FORCE.value:
        return
    current = config.to_dict()
    # A key the run's config lacks came with a newer config file: no change unless
    # overridden now (a different state would not restore anyway, with its own error).
    overridden = set(config_flags.get_override_values(FLAGS["config"]))
    changes = config_differences(
        {k: saved.get(k) for k in ("experiment", "model")},
        {k: current.get(k) for k in ("experiment", "model")},
        added_ok=lambda key: not any(o == key or o.startswith(f"{key}.") for o in overridden),
    )
    if changes:
        raise UsageError(
            f"{workdir} holds a run of another experiment ({'; '.join(changes)}); "
            "use another --workdir, or --force to train there anyway"
        )


def _saved_path(workdir: str) -> str:
    return storage.join(workdir, "config.json")


def _overrides_text() -> str:
    overrides = config_flags.get_override_values(FLAGS["config"])
    shown = " ".join(f"--config.{k}={v}" for k, v in overrides.items())
    return f" with {shown}" if shown else ""


def _argv_value(argv: list[str], name: str) -> str | None:
    """The value of ``--name`` in ``argv`` (``--name=v`` or ``--name v``), before any ``--``."""
    value = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg in (f"--{name}", f"-{name}") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith((f"--{name}=", f"-{name}=")):
            value = arg.split("=", 1)[1]
    return value


# ---------------------------------------------------------------- help


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: python -m replicator COMMAND [flags]",
        "",
        "commands:",
        *(f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()),
        "",
        "`python -m replicator COMMAND --help` shows a command's flags (and config keys).",
        "Example: python -m replicator train --config configs/digits_cnn.py --workdir runs/digits",
    ]
    return "\n".join(lines)


def _load_flags_for_help(argv: list[str]) -> None:
    """Parses the flags that were given with ``--help``, to show a config's values."""
    rest = [a for a in argv if a not in _HELP]
    value = _argv_value(rest, "config")
    if value is not None and not os.path.isfile(value.split(":", 1)[0]):
        raise UsageError(f"config file {value.split(':', 1)[0]!r} does not exist")
    sys.argv = rest
    try:
        FLAGS(rest)
    except Exception as e:  # noqa: BLE001
        raise _flag_error(e) from e


def _command_help(command: str) -> str:
    what = COMMANDS[command]
    lines = [
        f"usage: python -m replicator {_SYNOPSIS[command]}",
        "",
        f"{what[0].upper()}{what[1:]}.",
    ]
    if command == "plot":
        return "\n".join(lines)
    lines += ["", "flags:"]
    for holder in _FLAGS_OF[command]:
        flag = FLAGS[holder.name]
        name = f"--[no]{flag.name}" if flag.boolean else f"--{flag.name}"
        default = flag.default not in (None, False) and flag.name != "config"
        shown = flag.help + (f" (default: {flag.default})" if default else "")
        lines.append(_wrap(f"  {name:<17} {shown}", indent=20))
    given = FLAGS["config"].present or not _CONFIG_FILE_GIVEN
    return "\n".join([*lines, "", *_keys_table(FLAGS.config if given else None)])


def _keys_table(config) -> list[str]:
    """Every config key with its default and meaning (`describe_keys`, the one table),
    and ``config``'s values when there is one (its ``model`` settings each on a row)."""
    from replicator.trainer.config import describe_keys

    head, rows = ("KEY", "DEFAULT", "MEANING"), []
    values = {} if config is None else config.to_dict()
    for key, default, meaning in describe_keys():
        value = values.get(key)
        if config is None:
            rows.append((key, default, meaning))
        elif key == "model" and isinstance(value, dict):
            rows.append((key, default, "", meaning))
            rows += [(f"model.{k}", "", _clip(repr(v)), "") for k, v in value.items()]
        else:
            rows.append((key, default, _clip(repr(value)) if key in values else "", meaning))
    title = "config keys (override any with --config.KEY=VALUE):"
    if config is not None:
        head = ("KEY", "DEFAULT", "THIS CONFIG", "MEANING")
        title = f"config keys (override any with --config.KEY=VALUE), {_config_source()}:"
    widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head) - 1)]
    cells = ("  ".join(f"{c:<{w}}" for c, w in zip(row, widths)) for row in (head, *rows))
    return [title, *(f"  {line}  {row[-1]}".rstrip() for line, row in zip(cells, (head, *rows)))]


def _config_source() -> str:
    if not _CONFIG_FILE_GIVEN:
        return _saved_path(_WORKDIR.value or "WORKDIR")
    return FLAGS["config"].config_filename


def _wrap(text: str, indent: int, width: int = 100) -> str:
    return textwrap.fill(text, width=width, subsequent_indent=" " * indent)


def _clip(text: str, width: int = 32) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


# ---------------------------------------------------------------- errors


def _is_user_error(error: BaseException) -> bool:
    """A mistake in the input, not a bug: our own usage errors, the flag parser's,
    config errors (`ConfigError`, which experiments raise for their own settings
    too), the checkpoint errors, and the ``ValueError``/``FileNotFoundError`` that
    replicator's own code raises when it checks what it was given (any other
    ValueError from deeper down, from JAX or an experiment, is a bug to debug)."""
    from replicator.checkpoint import CheckpointMismatchError, CorruptCheckpointError
    from replicator.trainer.config import ConfigError

    input_errors = (UsageError, app.UsageError, flags.Error, ConfigError, storage.StorageError)
    if isinstance(error, (*input_errors, CheckpointMismatchError, CorruptCheckpointError)):
        return True
    if isinstance(error, (ValueError, FileNotFoundError)):
        return _raised_in_replicator(error)
    return False


def _raised_in_replicator(error: BaseException) -> bool:
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tb = error.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and os.path.abspath(last.tb_frame.f_code.co_filename).startswith(
        package + os.sep
    )


def _flag_error(error: BaseException) -> UsageError:
    """A flag parser's error (or a config file's), as one line."""
    text = str(error)
    unknown = re.search(r'Did you mean "([^"]+)" instead of "([^"]+)"', text)
    if isinstance(error, (AttributeError, KeyError)) and unknown:
        close, key = unknown.groups()
        for arg in sys.argv:  # ml_collections names the last part of a nested key only
            path = re.match(r"-?-config\.([\w.]+)", arg)
            if path and path.group(1).split(".")[-1] == key:
                prefix = path.group(1)[: -len(key)]
                key, close = prefix + key, prefix + close
        return UsageError(f"unknown config key {key!r} (did you mean {close!r}?)")
    if isinstance(error, (AttributeError, KeyError)):
        return UsageError(f"unknown config key: {_one_line(text)}")
    unset = re.search(
        r'Override ([\w.]+) can not be applied because field "([\w.]+)" is None', text
    )
    if unset:
        key, parent = unset.groups()
        sub = key[len(parent) + 1 :]
        return UsageError(
            f"config.{parent} is None in this config, so config.{key} cannot be set alone; "
            f"""set it whole, e.g. --config.{parent}="{{'{sub}': VALUE}}\""""
        )
    literal = re.search(r"Failed to parse '(.*)' as a ConfigDict", text)
    if literal:
        return UsageError(
            f"cannot read {literal.group(1)!r} as a dict: write a Python literal, e.g. "
            """--config.mesh="{'data': 4}", or set one key, e.g. --config.mesh.data=4"""
        )
    return UsageError(_one_line(text))


def _one_line(text: str) -> str:
    """A message as one line: a traceback's last line; a list's items joined by '; '."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    if any(line.startswith("Traceback") for line in lines):
        lines = lines[-1:]
    if not lines:
        return ""
    head, items = lines[0], [line.removeprefix("- ") for line in lines[1:]]
    return head + (" " + "; ".join(items) if items else "")


def _debug_requested(argv: Sequence[str]) -> bool:
    if os.environ.get("REPLICATOR_DEBUG", "") not in ("", "0"):
        return True
    return "--debug" in argv or "-debug" in argv or "--debug=true" in argv


def _exit_with(error: BaseException, *, debug: bool, cause: BaseException | None = None) -> None:
    """Reports an input error found before the console is set up, and exits."""
    if debug:
        traceback.print_exception(cause or error, file=sys.stderr)
    print(f"error: {_one_line(str(error))}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def _process_count() -> int:
    if "jax" not in sys.modules:
        return 1
    import jax

    try:
        return jax.process_count()
    except Exception:  # noqa: BLE001  (JAX failed to start: one process as far as we know)
        return 1
