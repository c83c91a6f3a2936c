"""What ``--help`` shows: the commands, a command's flags and every config key.

The config keys come from `replicator.trainer.config.describe_keys`: the
trainer's table of keys, defaults and meanings, and with a config given (``train
--config FILE --help``, or ``eval --workdir DIR --help`` on a run's saved config)
its experiment's own keys (`replicator.trainer.ConfigKeys`: the LM's remat and
pipeline keys, ``model.KEY`` for each of its model keys) and a column of the
config's values.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

import ml_collections
from absl import flags

from replicator.trainer.config import describe_keys, experiment_keys

COMMANDS = {
    "train": "train a config's experiment in WORKDIR, resuming from its newest checkpoint",
    "eval": "evaluate a checkpoint of WORKDIR on the devices there are now (JSON off a terminal); "
    "--tasks: lm-eval-harness benchmarks",
    "compile": "compile a config's steps for a Cloud TPU slice here: memory per chip, FLOPs, "
    "collectives, a roofline (--fit: the fastest remat/accumulation/offload that fits)",
    "plot": "draw WORKDIR's metrics as PNG files in WORKDIR/plots/",
    "sample": "continue prompts with a checkpoint of WORKDIR (or config.init_from's weights)",
    "export": "write a checkpoint of WORKDIR in Hugging Face's layout (config.json, safetensors)",
    "params": "list a config's parameter paths, shapes and what freeze, lr_mults and weight "
    "decay do to each (nothing trained or written)",
    "launch": "run a command as every process of a multi-process run: local, tpu or slurm",
}
SYNOPSIS = {
    "train": "train --config FILE[:MODE] --workdir DIR [--config.KEY=VALUE ...] [flags]",
    "eval": "eval --workdir DIR [--config FILE[:MODE]] [--config.KEY=VALUE ...] [--tasks T1,T2 "
    "[--include_path DIR] [--limit N]] [flags]",
    "compile": "compile --config FILE[:MODE] --topology TYPE [--slices N] [--workdir DIR] "
    "[--fit] [--config.KEY=VALUE ...]",
    "plot": "plot WORKDIR",
    "export": "export --workdir DIR [--step N] --format {hf,peft} --out DIR",
    "params": "params --config FILE[:MODE] [--config.KEY=VALUE ...]",
    "sample": "sample --workdir DIR [--config FILE[:MODE]] (--prompt TEXT | --prompt_ids 1,2,3) "
    "[--max_new_tokens N --temperature T --top_k K --top_p P --seed S --num_samples N] [--json]",
}


def usage() -> str:
    """``python -m replicator --help``: the commands, each in one line."""
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


def command_help(
    command: str,
    flag_names: Sequence[str],
    config: ml_collections.ConfigDict | None = None,
    source: str = "",
) -> str:
    """``python -m replicator COMMAND --help``.

    Args:
      command: ``train``, ``eval``, ``compile`` or ``plot``.
      flag_names: the command's flags, in the order to show them.
      config: the config given, whose values are shown beside the keys' defaults.
      source: where ``config`` came from (a file, a run's ``config.json``).
    """
    what = COMMANDS[command]
    lines = [
        f"usage: python -m replicator {SYNOPSIS[command]}",
        "",
        f"{what[0].upper()}{what[1:]}.",
    ]
    if command == "plot":
        return "\n".join(lines)
    lines += ["", "flags:"]
    for flag in (flags.FLAGS[name] for name in flag_names):
        name = f"--[no]{flag.name}" if flag.boolean else f"--{flag.name}"
        default = flag.default not in (None, False) and flag.name != "config"
        shown = flag.help + (f" (default: {flag.default})" if default else "")
        lines.append(textwrap.fill(f"  {name:<17} {shown}", width=100, subsequent_indent=" " * 20))
    if command == "export":  # the run's own config: no keys to set
        return "\n".join(lines)
    return "\n".join([*lines, "", *keys_table(config, source)])


def keys_table(config: ml_collections.ConfigDict | None, source: str = "") -> list[str]:
    """Every config key with its default and meaning (`describe_keys`): the trainer's, and
    with a ``config`` its experiment's own (``model.KEY`` rows for its model's) and a
    column of ``config``'s values."""
    head, rows = ("KEY", "DEFAULT", "MEANING"), []
    values = {} if config is None else config.to_dict()
    keys = None if config is None else experiment_keys(values.get("experiment"))
    described = describe_keys(keys)
    model = values.get("model") if isinstance(values.get("model"), dict) else {}
    # A model key the experiment does not declare (it checks its model itself): its value.
    described += [
        (f"model.{k}", "", "") for k in model if keys.model is None or k not in keys.model
    ]
    for key, default, meaning in described:
        if config is None:
            rows.append((key, default, meaning))
            continue
        name = key.removeprefix("model.")
        value = model.get(name) if key.startswith("model.") else values.get(key)
        given = name in model if key.startswith("model.") else key in values
        shown = _clip(repr(value)) if given and key != "model" else ""
        rows.append((key, default, shown, meaning))
    title = "config keys (override any with --config.KEY=VALUE):"
    if config is None:
        rows.append(("...", "", "with --config FILE: its experiment's keys, model keys included"))
    else:
        head = ("KEY", "DEFAULT", "THIS CONFIG", "MEANING")
        title = f"config keys (override any with --config.KEY=VALUE), {source}:"
    widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head) - 1)]
    cells = ("  ".join(f"{c:<{w}}" for c, w in zip(row, widths)) for row in (head, *rows))
    return [title, *(f"  {line}  {row[-1]}".rstrip() for line, row in zip(cells, (head, *rows)))]


def _clip(text: str, width: int = 32) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
