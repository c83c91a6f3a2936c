"""``python -m replicator sample``: continue prompts with a run's checkpoint.

The trainer restores the parameters as ``eval`` does (the run's config and mesh,
fitted to the devices there are; the newest checkpoint or ``--step N``) or, in a
workdir without checkpoints, loads ``config.init_from`` into a fresh model; the
experiment does the sampling. It never imports ``experiments/``: the config's
experiment module offers sampling through an optional hook beside
``make_experiment``:

``make_sampler(settings, tokenizer=spec) -> sampler``, with ``settings`` the
`replicator.trainer.Settings` the experiment was made from and ``spec`` the
config's ``tokenizer`` key; the sampler has ``encode(text) -> ids``,
``decode(ids) -> text``, ``eos_id`` (None: no default stop token),
``check(prompts, **options)`` (one-line errors, before anything is restored) and
``generate(params, prompts, **options)``, returning samples with ``prompt_index``,
``sample_index``, ``prompt_ids``, ``ids`` and ``finish_reason``.
``experiments.lm`` has one (`experiments.lm.sample`).

``--json`` prints one JSON object per sample: ``prompt_index``, ``sample_index``,
``prompt`` (the prompt's text: as given, or its ids decoded; None without a
tokenizer), ``prompt_ids``, ``ids`` (the generated tokens only; a stop token that
ended the sample last), ``text`` (their text, without that stop token),
``finish_reason`` (``"stop"`` or ``"length"``) and ``step`` (the checkpoint's, or
None for ``init_from``'s weights). Without it, one readable line per sample: the
prompt and its continuation (`readable`). With no checkpoint in the workdir, a line
says so and that the weights sampled are ``config.init_from``'s.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Sequence
from typing import Any

from absl import flags

from replicator.errors import ConfigError, UsageError

log = logging.getLogger("replicator")

_PROMPT = flags.DEFINE_multi_string("prompt", None, "sample: a prompt's text")
_PROMPT_IDS = flags.DEFINE_multi_string(
    "prompt_ids", None, "sample: a prompt's token ids, e.g. 1,2,3"
)
_MAX_NEW_TOKENS = flags.DEFINE_integer(
    "max_new_tokens", 64, "sample: tokens to generate per sample."
)
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "sample: 0 is greedy (the argmax).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "sample: only the k likeliest tokens (0: all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "sample: nucleus sampling's mass (1.0: all).")
_SEED = flags.DEFINE_integer("seed", 0, "sample: the sampling seed (same seed, same samples).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "sample: samples per prompt.")
_STOP_IDS = flags.DEFINE_string(
    "stop_ids",
    None,
    "sample: token ids that end a sample, e.g. 0,13 ('' for none); default: the "
    "tokenizer's end of document.",
)
_JSON = flags.DEFINE_bool(
    "json", False, "One JSON line per result (eval: also whenever stdout is no terminal) or sample."
)

FLAGS = (
    _PROMPT, _PROMPT_IDS, _MAX_NEW_TOKENS, _TEMPERATURE, _TOP_K, _TOP_P, _SEED, _NUM_SAMPLES,
    _STOP_IDS, _JSON,
)  # fmt: skip


def parse_ids(text: str, what: str) -> list[int]:
    """``"1,2, 3"`` -> ``[1, 2, 3]``; anything else is a one-line `UsageError`.

    >>> parse_ids("1,2, 3", "--prompt_ids"), parse_ids("", "--stop_ids")
    ([1, 2, 3], [])
    """
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(
            f"{what}={text!r}: give token ids separated by commas, e.g. 1,2,3"
        ) from None


def sample(
    config: Any,
    workdir: str,
    *,
    prompts: Sequence[str] = (),
    prompt_ids: Sequence[Sequence[int]] = (),
    step: int | None = None,
    stop_ids: Sequence[int] | None = None,
    devices: Any = None,
    strict: bool = False,
    **options: Any,
) -> list[dict[str, Any]]:
    """Continues prompts with a run's checkpoint (or ``config.init_from``'s weights).

    Args:
      config: the run's config (``experiment``, ``model``, ``mesh``, ``precision``,
        ``tokenizer``, ``init_from`` matter); None reads ``WORKDIR/config.json``.
      workdir: the training run's directory (it may hold no checkpoint when the
        config has ``init_from``).
      prompts: prompts as text (the experiment's tokenizer encodes them).
      prompt_ids: prompts as token ids; give ``prompts`` or these, not both.
      step: the checkpoint's step (default: the newest).
      stop_ids: tokens that end a sample; None: the tokenizer's end of document.
      devices: the devices to sample on (default: all), whatever trained it.
      strict: fail on an unreadable checkpoint instead of using the previous one.
      **options: ``max_new_tokens``, ``temperature`` (0: greedy), ``top_k``, ``top_p``,
        ``seed``, ``num_samples``.

    Returns:
      One record per sample (see the module docstring for its keys), in order.

    Raises:
      UserError: no prompt or both kinds, no checkpoint and no ``init_from``, a prompt
        too long for the model, a bad option: one line each.
    """
    from replicator import storage
    from replicator.trainer import evaluator, pretrained
    from replicator.trainer.setup import setup

    if bool(prompts) == bool(prompt_ids):
        raise UsageError("give the prompts as text (--prompt) or as ids (--prompt_ids), one kind")
    if config is None:
        config = evaluator.run_config(workdir)
        if config is None:
            raise ConfigError(
                f"{storage.join(workdir, 'config.json')} does not exist; pass the config"
            )
    # With init_from='hf:DIR' the model's keys are the checkpoint's (a no-op where they are).
    config = pretrained.checkpoint_model(config, required=False)
    run = setup(config, devices=devices, training=False)
    try:
        sampler = _make_sampler(run)
        ids = [sampler.encode(text) for text in prompts] or [list(p) for p in prompt_ids]
        texts = list(prompts) or [sampler.decode(p) for p in ids]
        if stop_ids is None:
            stop_ids = () if sampler.eos_id is None else (sampler.eos_id,)
        options = {**options, "stop_ids": tuple(int(i) for i in stop_ids)}
        sampler.check(ids, **options)  # before anything is read
        params, restored = restore_params(run, workdir, step, strict)
        samples = sampler.generate(params, ids, **options)
    finally:
        run.close()
    stop = set(options["stop_ids"])
    records = []
    for s in samples:
        kept = s.ids[:-1] if s.finish_reason == "stop" and s.ids and s.ids[-1] in stop else s.ids
        records.append({
            "prompt_index": s.prompt_index, "sample_index": s.sample_index,
            "prompt": texts[s.prompt_index], "prompt_ids": list(s.prompt_ids), "ids": list(s.ids),
            "text": sampler.decode(kept), "finish_reason": s.finish_reason, "step": restored,
        })  # fmt: skip
    return records


def _make_sampler(run: Any) -> Any:
    """The experiment module's ``make_sampler(settings, tokenizer=...)``; one without
    it is a one-line `ConfigError`."""
    path = run.config.experiment
    make = getattr(importlib.import_module(path), "make_sampler", None)
    if not callable(make):
        raise ConfigError(
            f"config.experiment={path!r} cannot sample: its module has no "
            "make_sampler(settings, tokenizer=...) (experiments.lm has one)"
        )
    return make(run.settings, tokenizer=run.config.get("tokenizer", None) or "bytes")


def restore_params(
    run: Any, workdir: str, step: int | None, strict: bool, doing: str = "sampling"
) -> tuple[Any, Any]:
    """The parameters to sample or evaluate (``sample``, ``eval --tasks``), on the run's
    shardings, and the step they come from: the workdir's checkpoint (``step`` or the
    newest), else ``config.init_from``'s weights in a fresh model (step None).

    Args:
      run: set up from the run's config (`replicator.trainer.setup.setup`, ``training=False``).
      workdir: the training run's directory (it may hold no checkpoint, or not exist).
      step: the checkpoint's step; None: the newest readable one.
      strict: fail on an unreadable newest checkpoint instead of using the previous one.
      doing: what the weights are for, in the line that says no checkpoint was found.

    Returns:
      ``(params, step)``; ``step`` is None for ``init_from``'s weights.

    Raises:
      ConfigError: ``--step`` without checkpoints, or neither a checkpoint nor ``init_from``.
    """
    from replicator import storage
    from replicator.trainer import evaluator, init_from, pretrained

    config = run.config
    restored = evaluator.restore_params(run, workdir, step=step, strict=strict)
    if restored is not None:
        return restored
    directory = storage.join(workdir, "checkpoints")
    if step is not None:
        raise ConfigError(f"--step={step}: {directory} holds no checkpoint")
    if config.init_from is None:
        raise ConfigError(
            f"{directory} holds no checkpoint and config.init_from is None: train first, or "
            "start from pretrained weights with --config.init_from=hf:DIR (or another run's "
            "workdir)"
        )
    log.warning(
        "%s holds no checkpoint: %s the weights of config.init_from=%r as they are",
        directory, doing, config.init_from,
    )  # fmt: skip
    # A run's checkpoint or, with hf:DIR, a Hugging Face one (config.model shaped by it).
    copies = run.experiment.copies  # (a DPO run's reference: the starting weights)
    targets = tuple(target for target, _ in copies)
    the_plan, arrays = pretrained.load(config, run.abstract_state, run.repl, targets)
    log.info("%s", the_plan.report())
    view = init_from.place(the_plan, arrays, run.init_eval_state())
    view = init_from.copy_leaves(view, copies)
    return view["params"], None


def check_flags() -> tuple[list[list[int]], list[int] | None]:
    """The ``--prompt_ids`` and ``--stop_ids`` given, parsed; one-line `UsageError`s for
    them and for prompts of both kinds or neither."""
    if bool(_PROMPT.value) == bool(_PROMPT_IDS.value):
        raise UsageError("give the prompts as text (--prompt) or as ids (--prompt_ids), one kind")
    prompt_ids = [parse_ids(text, "--prompt_ids") for text in _PROMPT_IDS.value or ()]
    stop_ids = None if _STOP_IDS.value is None else parse_ids(_STOP_IDS.value, "--stop_ids")
    return prompt_ids, stop_ids


def main(config: Any, workdir: str, console: Any, chief: bool, step: int | None, strict: bool):
    """``sample`` with the parsed flags: each sample printed by process 0."""
    prompt_ids, stop_ids = check_flags()
    records = sample(
        config, workdir, prompts=_PROMPT.value or (), prompt_ids=prompt_ids, step=step,
        stop_ids=stop_ids, strict=strict, max_new_tokens=_MAX_NEW_TOKENS.value,
        temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
        seed=_SEED.value, num_samples=_NUM_SAMPLES.value,
    )  # fmt: skip
    if not chief:
        return
    for record in records:
        console.print(json.dumps(record) if _JSON.value else readable(record))


def readable(record: dict[str, Any]) -> str:
    """One sample as a line: which one (prompt.sample), the prompt, then ``+`` and what
    was generated, as text with escapes (or ids, without a tokenizer), and how it ended.

    >>> readable({"prompt_index": 0, "sample_index": 1, "prompt": "x=", "text": "a\\nb",
    ...           "prompt_ids": [120, 61], "ids": [97, 10, 98], "finish_reason": "length"})
    "[0.1] 'x=' + 'a\\\\nb' (3 tokens, length)"
    >>> readable({"prompt_index": 1, "sample_index": 0, "prompt": None, "text": None,
    ...           "prompt_ids": [1, 2], "ids": [3], "finish_reason": "stop"})
    '[1.0] [1, 2] + [3] (1 tokens, stop)'
    """
    texts = record.get("prompt") is not None and record.get("text") is not None
    prompt = repr(record["prompt"]) if texts else str(record.get("prompt_ids", []))
    shown = repr(record["text"]) if texts else str(record["ids"])
    where = f"[{record['prompt_index']}.{record['sample_index']}]"
    return f"{where} {prompt} + {shown} ({len(record['ids'])} tokens, {record['finish_reason']})"
