"""Command line: ``python -m replicator {train,eval,compile,plot,launch} ...``, dispatched.

``train`` and ``eval`` run a config (`replicator.trainer.config_files` resolves
it: the ``--config`` file, or the run's own ``WORKDIR/config.json`` for eval,
with ``--config.key=value`` overrides on top); ``compile`` compiles a config's
steps for a Cloud TPU topology (`replicator.trainer.aot`); ``plot`` draws a
run's metrics; ``launch`` is `replicator.runtime.launch`.

What a person sees:

* ``--help`` at every level (`replicator.trainer.help_text`): the subcommands;
  a subcommand's flags and, for ``train``/``eval``, every config key with its
  default and meaning, plus the given config's values.
* A mistake in the input, a `replicator.errors.UserError` (a flag, the config,
  the workdir, the mesh, the batch, a checkpoint that does not fit), ends in one
  line, ``error: ...``, and exit status 2; ``--debug`` or ``REPLICATOR_DEBUG=1``
  adds the traceback. Anything else is a bug and keeps its traceback (exit
  status 1).
* A storage that does not answer (`replicator.storage.DEADLINE_S`, 60 s) is no
  mistake: one line, ``error: ... did not answer ...``, and exit status 75
  (``EX_TEMPFAIL``, as a stalled multi-process sync), within that bound of its
  silence, whatever was waiting for it (Orbax's commit included). Nothing is
  lost: the same command, rerun once the storage answers, resumes from the
  last checkpoint.
* A quiet console: replicator's own lines (progress bar, evals, summary,
  warnings). What the libraries underneath print (tfds, Orbax, absl, JAX, C++
  logs) goes to ``WORKDIR/log.txt`` instead, unless ``--verbose``.

Exit statuses: 0 done (or preempted, saved), 1 a bug, 2 a mistake in the input
(or ``compile``: does not fit), 75 storage unavailable, 130 interrupted.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import sys
import traceback
from collections.abc import Sequence

from absl import app, flags

from replicator import storage
from replicator.errors import StorageUnavailableError, UsageError, UserError
from replicator.trainer import config as config_lib
from replicator.trainer import config_files, harness, sample_command
from replicator.trainer.config_files import HELP
from replicator.trainer.console import Console, one_line, result_line
from replicator.trainer.help_text import COMMANDS, SYNOPSIS, command_help, usage

USAGE_ERROR = 2  # exit status of a mistake in the input (1: a bug, with its traceback)
STORAGE_UNAVAILABLE = 75  # EX_TEMPFAIL: the storage did not answer; rerun to resume
_RERUN = "; nothing is lost: rerun the same command once the storage answers"

_CONFIG = config_files.CONFIG
_JSON = next(holder for holder in sample_command.FLAGS if holder.name == "json")  # eval's too
_WORKDIR = flags.DEFINE_string(
    "workdir", None,
    "The run's directory: train writes its metrics, logs and checkpoints there; eval, "
    "sample and export read them; compile writes its report there.",
)  # fmt: skip
_STEP = flags.DEFINE_integer(
    "step", None, "The checkpoint to evaluate, sample or export (default: the newest)."
)
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
_EMA = flags.DEFINE_bool(
    "ema", False, "eval: only the moving average of the parameters (a run with ema_decay)."
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

_TOPOLOGY = flags.DEFINE_string(
    "topology",
    None,
    "compile: the Cloud TPU accelerator type to compile for, as gcloud names it "
    "(v4-32, v5e-16 or v5litepod-16, v5p-128, v6e-64, tpu7x-8).",
)
_SLICES = flags.DEFINE_integer(
    "slices",
    1,
    "compile: slices of --topology, joined by the data center network (a config "
    "without dcn_mesh gets dcn_mesh={'data': N}).",
)

_FIT = flags.DEFINE_bool(
    "fit",
    False,
    "compile: find the fastest program that fits: compile each remat policy, then more "
    "microbatches and the optimizer state offloaded where one does not fit; a table and "
    "the winner's overrides (replicator/trainer/fit.py).",
)
_FIT_JOBS = flags.DEFINE_integer(
    "fit_jobs",
    None,
    "compile --fit: candidates compiled at a time (default: 1 or 2, by cores and free memory).",
)
_PYTHON = flags.DEFINE_string(
    "python",
    None,
    "compile: compile with this Python's newest JAX and libtpu, the pods' (launch tpu's "
    "workers run Python 3.12 by default): a version (3.12) or an interpreter's path; its "
    "environment is made once with uv (replicator/runtime/compiler_env.py).",
)
_STEPS = flags.DEFINE_list(
    "steps", ["train", "eval", "decode"], "compile: the steps to compile (the train step always)."
)
_FORMAT = flags.DEFINE_enum(
    "format",
    None,
    ["hf", "peft"],
    "export: 'hf' (Hugging Face weights; a LoRA run's merged) or 'peft' (a LoRA run's "
    "adapters, HF PEFT's layout)",
)
_OUT = flags.DEFINE_string("out", None, "export: the directory to write (new or empty).")
_DTYPE = flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16", "float16"],
    "export: the weights' dtype (bfloat16 halves them, as checkpoints on the Hub are).",
)  # fmt: skip

_COMMON = (_VERBOSE, _DEBUG, _CPU_DEVICES, _COMPILE_CACHE, _INIT_TIMEOUT)
_FLAGS_OF = {
    "train": (_CONFIG, _WORKDIR, _QUIET, _STRICT, _FORCE, *_COMMON),
    "eval": (
        _CONFIG,
        _WORKDIR,
        _STEP,
        _STRICT,
        _EMA,
        _FOLLOW,
        _FOLLOW_TIMEOUT,
        _JSON,
        *harness.FLAGS,
        *_COMMON,
    ),
    "compile": (
        _CONFIG,
        _TOPOLOGY,
        _SLICES,
        _WORKDIR,
        _STEPS,
        _FIT,
        _FIT_JOBS,
        _PYTHON,
        _VERBOSE,
        _DEBUG,
    ),
    "export": (_WORKDIR, _STEP, _FORMAT, _OUT, _DTYPE, _VERBOSE, _DEBUG, _CPU_DEVICES),
    "sample": (_CONFIG, _WORKDIR, _STEP, *sample_command.FLAGS, _STRICT, *_COMMON),
    "params": (_CONFIG, _VERBOSE, _DEBUG, _CPU_DEVICES),
}


def run(argv: Sequence[str] | None = None) -> None:
    """``python -m replicator``: dispatches to a subcommand."""
    argv = list(sys.argv if argv is None else argv)
    command = argv[1] if len(argv) > 1 else None
    if command == "launch":
        from replicator.runtime import launch

        sys.exit(launch.main(argv[2:]))
    if command is None or command in HELP:
        print(usage())
        sys.exit(0 if command else USAGE_ERROR)
    if command == "compile":
        _compile_with_another_python(argv)
    try:
        if command not in COMMANDS:
            close = difflib.get_close_matches(command, COMMANDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(
                f"unknown command {command!r}{hint}; `python -m replicator --help` lists them"
            )
        argv = config_files.take_nulled(argv)  # --config.KEY=None, set after parsing
        argv = config_files.write_overrides_as_literals(argv)  # dict(a=1) -> {'a': 1}
        own_args = argv[2 : argv.index("--")] if "--" in argv else argv[2:]
        if command in ("eval", "sample"):
            config_files.use_the_runs_config(argv)
        if any(arg in HELP for arg in own_args):
            config_files.parse_for_help(argv)
            print(_command_help(command))
            sys.exit(0)
        config_files.check_config_file(argv)
    except UserError as e:  # the run's config.json, its bucket, the flags given with --help
        _exit_with(e, debug=_debug_requested(argv))
    sys.argv = argv  # ml_collections reads the config overrides from sys.argv
    app.run(main_or_exit, argv=argv, flags_parser=_parse_flags)


def _compile_with_another_python(argv: list[str]) -> None:
    """``compile --python X.Y``: the same command run by that Python's environment
    (`replicator.runtime.compiler_env`), its exit status this one's; nothing where the
    Python asked for is this one."""
    words, python, i = [], None, 2
    while i < len(argv):
        if argv[i] in ("--python", "-python") and i + 1 < len(argv):
            python, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith(("--python=", "-python=")):
            python = argv[i].split("=", 1)[1]
        else:
            words.append(argv[i])
        i += 1
    from replicator.runtime import compiler_env

    if not python or compiler_env.is_here(python) or any(arg in HELP for arg in words):
        return
    try:
        interpreter = compiler_env.interpreter(python)
    except UserError as e:
        _exit_with(e, debug=_debug_requested(argv))
    sys.exit(compiler_env.run(interpreter, ["compile", *words], asked=python))


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return flags.FLAGS(argv)
    except Exception as e:  # noqa: BLE001  (the config file's own errors land here too)
        _exit_with(config_files.flag_error(e, argv), debug=_debug_requested(argv), cause=e)


def main_or_exit(argv: list[str]) -> None:
    """`main`, with a `UserError` as one line (exit status 2; a storage outage: 75) and
    bugs with their traceback.

    In a multi-process run an error exits at once: a normal exit waits at JAX's
    shutdown barrier for the other processes, which are stuck in a collective
    waiting for this one, until a 5-minute timeout; exiting at once lets the
    launcher see the failure and stop the others.
    """
    console = Console(verbose=_VERBOSE.value or argv[1] == "plot")
    try:
        with _library_outage_as_storage_error():
            main(argv, console)
        console.close()
        return
    except SystemExit:
        console.close()
        raise
    except KeyboardInterrupt as e:  # before the training loop (which saves and stops)
        console.report(e, summary="interrupted")
        code = 130
    except StorageUnavailableError as e:
        debug = _debug_requested(sys.argv)
        console.report(e, summary=None if debug else f"error: {one_line(str(e))}{_RERUN}")
        _exit_after_outage(console)
    except UserError as e:
        debug = _debug_requested(sys.argv)
        console.report(e, summary=None if debug else f"error: {one_line(str(e))}")
        code = USAGE_ERROR
        console.discard_new_workdir()
    except BaseException as e:
        console.report(e, summary=None)
        code = 1
    try:
        console.close()  # a log in a bucket is uploaded before the process ends
    except OSError as e:
        console.err.write(f"warning: the log could not be uploaded: {e}\n")
    if _process_count() > 1:
        os._exit(code)
    sys.exit(code)


@contextlib.contextmanager
def _library_outage_as_storage_error():
    """A library's own error for a storage that did not answer (gcsfs's, tensorstore's,
    from a path that does not name it) as the `StorageUnavailableError` it stands for."""
    try:
        yield
    except Exception as e:
        outage = storage.failure(e, "reach the storage of", _WORKDIR.value or "the run")
        if not isinstance(outage, StorageUnavailableError) or outage is e:
            raise
        raise StorageUnavailableError(str(outage)) from e


def _exit_after_outage(console: Console) -> None:
    """Ends the process at once, with `STORAGE_UNAVAILABLE`: nothing to discard (the rerun
    resumes), and a library's thread still waiting for the storage (Orbax's commit,
    gcsfs's retries) must not hold it past the storage's deadline."""
    try:
        console.close()  # the log: one short try, the deadline having passed
    except OSError:
        pass  # the log's last lines are not in the bucket; the run's records are
    for stream in (sys.stdout, sys.stderr, console.out, console.err):
        stream.flush()
    os._exit(STORAGE_UNAVAILABLE)


def main(argv: list[str], console: Console) -> None:
    """Runs ``train``, ``eval``, ``compile`` or ``plot`` with the parsed flags."""
    command = argv[1]
    if command == "plot":
        _plot(argv)
        return
    if len(argv) > 2:
        raise UsageError(f"unexpected arguments {argv[2:]}; flags are written --name=value")
    if command == "compile":
        _compile(console)
        return
    if command == "export":
        _export(console)
        return
    if command == "params":
        _params(console)
        return
    for flag in (_CONFIG, _WORKDIR):
        if flag.value is None:
            raise UsageError(f"--{flag.name} is required; see `python -m replicator {command} -h`")
    if command == "sample":
        sample_command.check_flags()  # before JAX starts
    tasks = harness.check_flags(_FOLLOW, _EMA) if command == "eval" else None  # lm_eval's too
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
    workdir = _WORKDIR.value
    if storage.is_remote(workdir):  # a missing bucket or no answer: one line, before anything
        storage.check_writable(workdir) if command == "train" else storage.check_bucket(workdir)
    elif os.path.exists(workdir) and not os.path.isdir(workdir):
        raise UsageError(f"--workdir {workdir} is a file, not a directory")
    # A sidecar waits for the workdir; lm_eval's tasks may run config.init_from's weights.
    if command == "eval" and not (_FOLLOW.value or tasks) and not storage.isdir(workdir):
        raise UsageError(f"--workdir {workdir} does not exist (a mistyped path?)")
    config = config_files.config_for(command, workdir)  # sample's: as eval's, the run's own
    # init_from='hf:DIR' whose weights will be read (nothing to resume): its files checked
    # too, before the line that says what it changed and before the log is written.
    reads_weights = command != "eval" or tasks is not None
    fresh = reads_weights and not storage.exists(storage.join(workdir, "checkpoints"))
    config = _with_checkpoint_model(config, required=command == "train", check_files=fresh)
    config_lib.validate(config)  # every key, the experiment's too: before the workdir is touched
    if command == "train":
        config_files.check_workdir(config, workdir, force=_FORCE.value)
        from replicator.trainer import data

        data.prepare_own(config.dataset, config.data_dir)  # a mistake in the data: one line
    console.log_to(workdir, jax.process_index(), " ".join(sys.argv[1:]), create=command == "train")
    if command == "train":
        _train(config, workdir, console, chief)
    elif command == "sample":
        sample_command.main(config, workdir, console, chief, _STEP.value, _STRICT.value)
    elif tasks is not None:
        harness.main(config, workdir, console, chief, _STEP.value, _STRICT.value, _JSON.value)
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

    split = config.get("eval_split", "test")

    # A line for a person at a terminal; one JSON line (DESIGN's contract) wherever the
    # output goes to a program or a file, or with --json.
    as_json = _JSON.value or not console.out.isatty()

    def show(result: dict) -> None:
        if chief:
            console.print(json.dumps(result) if as_json else result_line(result, split))

    if _FOLLOW.value:  # a line per result, as it comes
        trainer.follow(config, workdir, timeout_s=_FOLLOW_TIMEOUT.value, on_result=show)
        return
    show(trainer.evaluate(config, workdir, step=_STEP.value, strict=_STRICT.value, ema=_EMA.value))


def _compile(console: Console) -> None:
    """``compile``: the config's steps compiled for ``--topology``; exit status 2 when
    they do not fit a chip (the report is written either way)."""
    from replicator.compiled import topology as topology

    if _CONFIG.value is None:
        raise UsageError("--config is required; see `python -m replicator compile -h`")
    if _TOPOLOGY.value is None:
        raise UsageError(
            "--topology is required: the accelerator type to compile for, e.g. --topology "
            f"v5e-16; the known ones: {topology.KNOWN_NAMES}"
        )
    if _SLICES.value < 1:
        raise UsageError(f"--slices={_SLICES.value}: give 1 or more slices")
    topology.accelerator(_TOPOLOGY.value)  # an unknown name or no libtpu: one line, at once
    topology.check_libtpu()
    import jax

    jax.config.update("jax_platforms", "cpu")  # compile for the topology; take no local TPU
    from replicator.trainer import aot

    config_file = flags.FLAGS["config"].config_filename
    workdir = _WORKDIR.value or aot.default_workdir(config_file, _TOPOLOGY.value, _SLICES.value)
    if storage.is_remote(workdir):
        storage.check_writable(workdir)
    elif os.path.exists(workdir) and not os.path.isdir(workdir):
        raise UsageError(f"--workdir {workdir} is a file, not a directory")
    # init_from='hf:DIR' not on this machine (a pod's disk): the shape is config.model's.
    config = _with_checkpoint_model(config_files.config_for("compile", workdir), required=False)
    overrides = aot.overrides_of(config_files.overrides_text())
    if _FIT.value:
        from replicator.trainer import fit

        if not fit.main(config, config_file, overrides, _TOPOLOGY.value, _SLICES.value,
                        workdir, _FIT_JOBS.value, console):  # fmt: skip
            sys.exit(USAGE_ERROR)
        return
    report = aot.compile_for_topology(
        config, _TOPOLOGY.value, slices=_SLICES.value, workdir=workdir, overrides=overrides,
        steps=_STEPS.value,
    )  # fmt: skip
    # The log joins the report only now: a config refused on the way leaves no directory.
    where = aot.report_dir(workdir, overrides)
    console.log_to(where, 0, " ".join(sys.argv[1:]), create=True)
    for line in aot.summary_lines(report):
        console.print(line)
    from replicator.runtime import compiler_env, worker_env

    asked = _PYTHON.value or os.environ.get(compiler_env.ASKED_PYTHON)  # a Python chosen
    older = sys.version_info[:2] < tuple(map(int, worker_env.DEFAULT_PYTHON.split(".")))
    if older and not asked:
        console.print(
            f"(launch tpu's workers run Python {worker_env.DEFAULT_PYTHON} and its JAX, "
            f"with a newer libtpu: add --python {worker_env.DEFAULT_PYTHON} to compile as "
            "they will)"
        )
    console.print(f"report: {storage.join(where, 'report.json')}")
    if not report.fits:
        sys.exit(USAGE_ERROR)


def _with_checkpoint_model(config, required: bool = True, check_files: bool = False):
    """init_from='hf:DIR': the model's shape from DIR/config.json, before the workdir's
    saved config is compared with it (`replicator.trainer.pretrained.checkpoint_model`)."""
    from replicator.trainer import pretrained

    return pretrained.checkpoint_model(config, required=required, check_files=check_files)


def _export(console: Console) -> None:
    """``export``: a run's checkpoint as a Hugging Face checkpoint, or its LoRA adapters as
    Hugging Face PEFT's (``--format peft``; `replicator.trainer.export`)."""
    for flag in (_WORKDIR, _FORMAT, _OUT):
        if flag.value is None:
            raise UsageError(f"--{flag.name} is required; see `python -m replicator export -h`")
    import jax

    if _CPU_DEVICES.value:
        jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
    from replicator.trainer import export

    exported = export.export_run(
        _WORKDIR.value, _OUT.value, format=_FORMAT.value, step=_STEP.value, dtype=_DTYPE.value
    )
    console.print(exported.report())


def _params(console: Console) -> None:
    """``params``: the config's parameter paths, shapes and optimizer keys
    (`replicator.trainer.params_command`); nothing trained or written."""
    if _CONFIG.value is None:
        raise UsageError("--config is required; see `python -m replicator params -h`")
    import jax

    if _CPU_DEVICES.value:
        jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
    from replicator.trainer import params_command

    params_command.main(config_files.config_for("params", ""), console)


def _plot(argv: list[str]) -> None:
    from replicator.trainer.plot import plot_metrics

    workdir = argv[2] if len(argv) == 3 else _WORKDIR.value
    if workdir is None or len(argv) > 3:
        raise UsageError(f"usage: python -m replicator {SYNOPSIS['plot']}")
    if not storage.isfile(storage.join(workdir, "metrics.jsonl")):
        raise UsageError(f"{workdir} has no metrics.jsonl to plot")
    for path in plot_metrics(workdir):
        print(path)


def _command_help(command: str) -> str:
    """A command's help, with the values of the config given (if one is)."""
    names = [holder.name for holder in _FLAGS_OF.get(command, ())]
    if not (flags.FLAGS["config"].present or not config_files.file_given()):
        return command_help(command, names)
    source = config_files.config_source(_WORKDIR.value)
    return command_help(command, names, config=flags.FLAGS.config, source=source)


def _debug_requested(argv: Sequence[str]) -> bool:
    if os.environ.get("REPLICATOR_DEBUG", "") not in ("", "0"):
        return True
    return "--debug" in argv or "-debug" in argv or "--debug=true" in argv


def _exit_with(error: BaseException, *, debug: bool, cause: BaseException | None = None) -> None:
    """Reports an input error found before the console is set up, and exits."""
    if debug:
        traceback.print_exception(cause or error, file=sys.stderr)
    if isinstance(error, StorageUnavailableError):
        print(f"error: {one_line(str(error))}{_RERUN}", file=sys.stderr)
        sys.exit(STORAGE_UNAVAILABLE)
    print(f"error: {one_line(str(error))}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def _process_count() -> int:
    if "jax" not in sys.modules:
        return 1
    import jax

    try:
        return jax.process_count()
    except Exception:  # noqa: BLE001  (JAX failed to start: one process as far as we know)
        return 1
