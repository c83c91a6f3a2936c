"""Command line: ``python -m replicator train|eval --config FILE --workdir DIR``, and
``python -m replicator launch {local,tpu,slurm} ... -- COMMAND`` (`replicator.runtime.launch`).

Configs are ml_collections files; any key can be overridden with
``--config.key=value`` (type-checked). ``train`` ends by printing the final eval
metrics; ``eval`` prints one JSON line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

COMMANDS = ("train", "eval", "plot")

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Experiment config file, e.g. configs/digits_cnn.py[:smoke].",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics and checkpoints.")
_STEP = flags.DEFINE_integer("step", None, "eval: the checkpoint step (default: latest).")
_QUIET = flags.DEFINE_bool("quiet", False, "train: no progress bar.")
_STRICT = flags.DEFINE_bool(
    "strict", False, "Fail on an unreadable checkpoint instead of using the previous one."
)
_FOLLOW = flags.DEFINE_bool(
    "follow", False, "eval: evaluate every new checkpoint as training writes it (sidecar)."
)
_FOLLOW_TIMEOUT = flags.DEFINE_float(
    "follow_timeout", None, "eval --follow: stop after this many seconds without a new checkpoint."
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


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[1] == "plot":
        from replicator.trainer.plot import plot_metrics

        workdir = argv[2] if len(argv) == 3 else _WORKDIR.value
        if workdir is None:
            raise app.UsageError("usage: python -m replicator plot WORKDIR")
        for path in plot_metrics(workdir):
            print(path)
        return
    if len(argv) != 2 or argv[1] not in COMMANDS:
        raise app.UsageError(
            "usage: python -m replicator {train,eval} --config FILE --workdir DIR | "
            "plot WORKDIR | launch ..."
        )
    for flag in (_CONFIG, _WORKDIR):
        if flag.value is None:
            raise app.UsageError(f"--{flag.name} is required.")
    import jax

    if _CPU_DEVICES.value:
        jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
    if _COMPILE_CACHE.value:
        jax.config.update("jax_compilation_cache_dir", _COMPILE_CACHE.value)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    from replicator.runtime.processes import detect_process_group, initialize_distributed

    initialize_distributed(detect_process_group(), timeout_s=_INIT_TIMEOUT.value)
    # Our own progress lines at INFO; the libraries' (Orbax's per-save chatter) only if WARNING+.
    absl_logging.set_verbosity(absl_logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("replicator")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if jax.process_index() == 0 else logging.WARNING)
    logger.propagate = False
    from replicator import trainer
    from replicator.trainer.preemption import Preempted

    chief = jax.process_index() == 0  # only process 0 prints results
    if argv[1] == "train":
        try:
            result = trainer.train_and_evaluate(
                _CONFIG.value, _WORKDIR.value, quiet=_QUIET.value, strict=_STRICT.value
            )
        except Preempted as e:
            if chief:
                print(e)
            return
        if chief:
            shown = ", ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, float))
            split = _CONFIG.value.get("eval_split", "test")
            print(
                f"Final {split} metrics after {result['step']} steps: {shown} "
                f"({result['num_examples']} examples)"
            )
    elif _FOLLOW.value:
        for result in trainer.follow(
            _CONFIG.value, _WORKDIR.value, timeout_s=_FOLLOW_TIMEOUT.value
        ):
            if chief:
                print(json.dumps(result))
    else:
        result = trainer.evaluate(
            _CONFIG.value, _WORKDIR.value, step=_STEP.value, strict=_STRICT.value
        )
        if chief:
            print(json.dumps(result))


def main_or_exit(argv: list[str]) -> None:
    """`main`; in a multi-process run an error exits at once.

    A normal exit waits at JAX's shutdown barrier for the other processes, which
    are stuck in a collective waiting for this one, until a 5-minute timeout.
    Exiting at once lets the others' launcher see the failure and stop them.
    """
    try:
        main(argv)
    except (app.UsageError, SystemExit):
        raise
    except BaseException:
        import jax

        if jax.process_count() == 1:
            raise
        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


def run() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "launch":
        from replicator.runtime import launch

        sys.exit(launch.main(sys.argv[2:]))
    app.run(main_or_exit)
