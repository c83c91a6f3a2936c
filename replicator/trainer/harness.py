"""``python -m replicator eval --tasks T1,T2``: lm-eval-harness benchmarks on a run's checkpoint.

The trainer restores the parameters as ``sample`` does (the run's config and mesh;
the newest checkpoint or ``--step N``, or, in a workdir without checkpoints,
``config.init_from``'s weights), and lm_eval (the ``eval`` extra: ``pip install -e
'.[eval]'``) runs the tasks against a model backend made here: `harness_model`, an
``lm_eval.api.model.TemplateLM`` that encodes requests as lm_eval's Hugging Face
backend (``--model hf``) does (context and continuation encoded whole and split;
an empty context scored after the start-of-document token, else the end one;
contexts and windows cut from the left to fit the model; ``loglikelihood_rolling``
in lm_eval's disjoint rolling windows; ``generate_until`` greedy, stopped at the
task's ``until`` strings and the end of document, at most ``max_gen_toks`` tokens)
and hands the token ids to the experiment. It never imports ``experiments/``: the
config's experiment module offers scoring through an optional hook beside
``make_experiment``:

``make_scorer(settings, tokenizer=spec, batch_size=N) -> scorer``, with ``settings``
the `replicator.trainer.Settings`, ``spec`` the config's ``tokenizer`` and ``N`` the
run's eval batch; the scorer has ``tokenizer`` (``encode(text, add_special_tokens=None)``,
``decode(ids, skip_special_tokens=True)``, ``eos_id``, ``bos_id``), ``max_length`` (the
model's context), ``loglikelihoods(params, [(context_ids, continuation_ids)])`` ->
``[(logprob, is_greedy)]`` and ``generate(params, prompts, max_new_tokens=, stop=)`` ->
generated ids. ``experiments.lm`` has one (`experiments.lm.harness`).

What it writes (process 0): lm_eval's results JSON (what its own CLI writes, without
the per-request samples) as ``WORKDIR/lm_eval/results_step<STEP>_<TIME>.json``
(``results_init_from_<TIME>.json`` for ``init_from``'s weights), a record ``{"step",
"split": "lm_eval", "TASK/METRIC": value, ...}`` in ``metrics.jsonl`` (filters other
than ``none`` as ``TASK/METRIC/FILTER``; step 0 for ``init_from``'s weights) and the same scalars in
TensorBoard as ``lm_eval/TASK/METRIC``. It prints one JSON line, ``{"step", "results",
"path"}`` with ``results`` as lm_eval reports it (task -> metric -> value), with
``--json`` or off a terminal; a readable line per task otherwise.

Offline: tasks are loaded with ``HF_DATASETS_OFFLINE=1`` and ``HF_HUB_OFFLINE=1``
unless the environment sets them. A local task is a YAML over local files
(``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}``) in
``--include_path DIR``; for a Hub task (hellaswag, arc_easy, ...) download its data
set into the Hugging Face cache first (e.g. ``datasets.load_dataset(...)`` on a
machine with internet, the cache copied over), or run with ``HF_DATASETS_OFFLINE=0``.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from absl import flags

from replicator.errors import ConfigError, UsageError

log = logging.getLogger("replicator")

_TASKS = flags.DEFINE_list(
    "tasks", None, "eval: lm-eval-harness tasks (names, groups or tags), e.g. hellaswag,arc_easy"
)
_INCLUDE_PATH = flags.DEFINE_string(
    "include_path", None, "eval --tasks: a directory of your own task YAMLs (lm_eval's)."
)
_LIMIT = flags.DEFINE_integer(
    "limit", None, "eval --tasks: at most this many examples per task (lm_eval's limit)."
)
FLAGS = (_TASKS, _INCLUDE_PATH, _LIMIT)
SPLIT = "lm_eval"  # the metrics.jsonl records' split
_OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def import_lm_eval() -> Any:
    """``lm_eval``, imported offline (`_OFFLINE`, unless set); missing, a one-line `UsageError`."""
    for name in _OFFLINE:
        os.environ.setdefault(name, "1")
    try:
        return importlib.import_module("lm_eval")
    except ImportError:
        raise UsageError("eval --tasks needs lm-eval-harness: pip install -e '.[eval]'") from None


@functools.cache
def task_manager(include_path: str | None = None) -> Any:
    """lm_eval's ``TaskManager`` over its own tasks and ``include_path``'s (built once:
    indexing lm_eval's thousands of YAMLs takes seconds)."""
    import_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path is not None and not os.path.isdir(include_path):
        raise UsageError(f"--include_path {include_path} is not a directory of task YAMLs")
    return TaskManager(include_path=include_path)


def check_tasks(tasks: Sequence[str], manager: Any) -> list[str]:
    """The task names, each one lm_eval knows (a task, group or tag); else one `UsageError`
    naming the unknown ones and the closest known names.

    Returns:
      The names, stripped, empty ones dropped.
    """
    names = [t.strip() for t in tasks if t.strip()]
    if not names:
        raise UsageError("--tasks is empty: name lm-eval-harness tasks, e.g. --tasks=hellaswag")
    known = set(manager.all_tasks)
    unknown = [t for t in names if t not in known and not os.path.isfile(t)]
    if unknown:
        close = sorted({c for t in unknown for c in difflib.get_close_matches(t, known, n=2)})
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UsageError(
            f"lm_eval knows no task {', '.join(map(repr, unknown))}{hint}; `lm_eval ls tasks` "
            "lists them, and --include_path DIR adds your own YAMLs"
        )
    return names


def check_flags(*plain_only: Any) -> list[str] | None:
    """The ``--tasks`` given (None: plain eval), checked against lm_eval's tasks before
    JAX starts or the workdir is touched; ``--limit`` below 1, or a flag of
    ``plain_only`` (plain eval's own, e.g. ``--follow``) set with ``--tasks``, is refused."""
    if _TASKS.value is not None:
        given = [f"--{flag.name}" for flag in plain_only if flag.value]
        if given:
            raise UsageError(f"eval --tasks evaluates one checkpoint's parameters: drop {given[0]}")
    if _TASKS.value is None:
        for flag in (_INCLUDE_PATH, _LIMIT):
            if flag.value is not None:
                raise UsageError(f"--{flag.name} goes with --tasks: name the tasks to run")
        return None
    if _LIMIT.value is not None and _LIMIT.value < 1:
        raise UsageError(f"--limit={_LIMIT.value}: give 1 or more examples per task")
    return check_tasks(_TASKS.value, task_manager(_INCLUDE_PATH.value))


def evaluate_tasks(
    config: Any,
    workdir: str,
    tasks: Sequence[str],
    *,
    include_path: str | None = None,
    limit: int | None = None,
    step: int | None = None,
    strict: bool = False,
    devices: Any = None,
    manager: Any = None,
    write: bool = True,
    log_samples: bool = False,
) -> dict[str, Any]:
    """Runs lm-eval-harness ``tasks`` on a run's checkpoint (or ``config.init_from``'s weights).

    Args:
      config: the run's config; None reads ``WORKDIR/config.json``.
      workdir: the training run's directory (without checkpoints: ``init_from``'s weights).
      tasks: lm_eval task, group or tag names.
      include_path: a directory of the user's task YAMLs.
      limit: at most this many examples per task.
      step: the checkpoint's step (default: the newest).
      strict: fail on an unreadable checkpoint instead of using the previous one.
      devices: the devices to evaluate on (default: all).
      manager: an lm_eval ``TaskManager`` to load the tasks with (default:
        `task_manager` of ``include_path``).
      write: write the results JSON and the metrics record into ``workdir``.
      log_samples: keep lm_eval's per-request ``samples`` in the returned ``lm_eval``.

    Returns:
      ``{"step", "results", "path", "lm_eval"}``: the checkpoint's step (None for
      ``init_from``'s), lm_eval's ``results`` (task -> metric -> value), the results
      JSON written (or None) and everything ``lm_eval.simple_evaluate`` returned.

    Raises:
      UserError: an unknown task, no lm_eval, an experiment without ``make_scorer``, no
        checkpoint and no ``init_from``: one line each, before anything is written.
    """
    import jax

    from replicator.trainer import sample_command

    lm_eval = import_lm_eval()
    manager = manager or task_manager(include_path)
    tasks = check_tasks(tasks, manager)
    run = _set_up(config, workdir, devices)
    try:
        scorer = _make_scorer(run)
        params, restored = sample_command.restore_params(run, workdir, step, strict, "scoring")
        model = harness_model(scorer, params, info={"workdir": workdir, "step": restored})
        out = lm_eval.simple_evaluate(
            model=model, tasks=tasks, task_manager=manager, limit=limit,
            log_samples=log_samples, model_args=f"workdir={workdir},step={restored}",
        )  # fmt: skip
    finally:
        run.close()
    path = write_results(workdir, restored, out) if write and jax.process_index() == 0 else None
    return {"step": restored, "results": out["results"], "path": path, "lm_eval": out}


def _set_up(config: Any, workdir: str, devices: Any) -> Any:
    """The run to evaluate, as ``sample`` sets it up: the config given or the run's own,
    the model's keys from ``init_from='hf:DIR'``'s config.json, the mesh fitted."""
    from replicator import storage
    from replicator.trainer import evaluator, pretrained
    from replicator.trainer.setup import setup

    if config is None:
        config = evaluator.run_config(workdir)
        if config is None:
            raise ConfigError(
                f"{storage.join(workdir, 'config.json')} does not exist; pass the config"
            )
    config = pretrained.checkpoint_model(config, required=False)
    return setup(config, devices=devices, training=False)


def _make_scorer(run: Any) -> Any:
    """The experiment module's ``make_scorer``; one without it is a one-line `ConfigError`."""
    path = run.config.experiment
    make = getattr(importlib.import_module(path), "make_scorer", None)
    if not callable(make):
        raise ConfigError(
            f"config.experiment={path!r} cannot run lm-eval-harness tasks: its module has no "
            "make_scorer(settings, tokenizer=..., batch_size=...) (experiments.lm has one)"
        )
    tokenizer = run.config.get("tokenizer", None) or "bytes"
    return make(run.settings, tokenizer=tokenizer, batch_size=run.eval_batch_size)


def write_results(workdir: str, step: int | None, out: Mapping[str, Any]) -> str:
    """lm_eval's results JSON into ``WORKDIR/lm_eval/`` and the scores into ``metrics.jsonl``
    and TensorBoard (`metrics_record`); returns the JSON's path."""
    from lm_eval.utils import handle_non_serializable

    from replicator import storage
    from replicator.trainer.writers import MetricWriter

    directory = storage.join(workdir, "lm_eval")
    storage.makedirs(directory)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    which = "init_from" if step is None else f"step{step}"
    path = storage.join(directory, f"results_{which}_{stamp}.json")
    kept = {k: v for k, v in out.items() if k != "samples"}
    text = json.dumps(kept, indent=2, default=handle_non_serializable, ensure_ascii=False)
    storage.write_text(path, text)
    # In a bucket objects are written whole: a file of its own, as the sidecar evaluator's.
    name = "metrics.sidecar.jsonl" if storage.is_remote(workdir) else "metrics.jsonl"
    writer = MetricWriter(workdir, resume_step=None, name=name)
    try:
        writer.write(step or 0, metrics_record(out["results"]), split=SPLIT)
    finally:
        writer.close()
    return path


def metrics_record(results: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """lm_eval's ``results`` as flat numbers: ``TASK/METRIC`` (``TASK/METRIC/FILTER`` for
    a filter other than ``none``); text (an alias, ``"N/A"``) left out.

    >>> metrics_record({"boolq": {"alias": "boolq", "acc,none": 0.5, "acc_stderr,none": "N/A",
    ...                           "exact_match,strict-match": 1.0}})
    {'boolq/acc': 0.5, 'boolq/exact_match/strict-match': 1.0}
    """
    record = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            if not isinstance(value, int | float) or isinstance(value, bool) or "," not in key:
                continue
            metric, _, applied = key.partition(",")
            name = f"{task}/{metric}" if applied == "none" else f"{task}/{metric}/{applied}"
            record[name] = float(value)
    return record


def readable(task: str, metrics: Mapping[str, Any]) -> str:
    """One task's scores as a line (standard errors beside their metric).

    >>> readable("boolq", {"alias": "boolq", "acc,none": 0.5, "acc_stderr,none": 0.1})
    'boolq: acc 0.5 ± 0.1'
    """
    shown = []
    for key, value in metrics.items():
        metric, _, applied = key.partition(",")
        if not applied or "_stderr" in metric or not isinstance(value, int | float):
            continue
        name = metric if applied == "none" else f"{metric} ({applied})"
        error = metrics.get(f"{metric}_stderr,{applied}")
        spread = f" ± {error:.4g}" if isinstance(error, int | float) else ""
        shown.append(f"{name} {value:.4g}{spread}")
    return f"{metrics.get('alias', task).strip()}: {', '.join(shown) or 'no scores'}"


def main(config: Any, workdir: str, console: Any, chief: bool, step: int | None, strict: bool,
         json_flag: bool) -> None:  # fmt: skip
    """``eval --tasks`` with the parsed flags: the scores printed by process 0, as one JSON
    line with ``--json`` or off a terminal (as plain eval's), else a line per task."""
    outcome = evaluate_tasks(
        config, workdir, _TASKS.value, include_path=_INCLUDE_PATH.value, limit=_LIMIT.value,
        step=step, strict=strict,
    )  # fmt: skip
    if not chief:
        return
    if json_flag or not console.out.isatty():
        shown = {k: outcome[k] for k in ("step", "results", "path")}
        console.print(json.dumps(shown, default=str))
        return
    for task, metrics in outcome["results"].items():
        console.print(readable(task, metrics))
    console.print(f"results: {outcome['path']}")


def harness_model(scorer: Any, params: Any, info: Mapping[str, Any] | None = None) -> Any:
    """An lm_eval model (``lm_eval.api.model.TemplateLM``) answering with ``scorer``.

    Args:
      scorer: what the experiment's ``make_scorer`` made (see the module docstring).
      params: the model's parameters, on the run's mesh.
      info: what the results JSON's ``config`` records about the model (workdir, step).

    Returns:
      The model, for ``lm_eval.simple_evaluate(model=...)``.
    """
    return _model_class()(scorer, params, dict(info or {}))


@functools.cache
def _model_class() -> type:
    """The `harness_model` class, made once lm_eval is imported (an optional extra)."""
    from lm_eval.api.model import TemplateLM

    class ReplicatorLM(TemplateLM):
        """lm_eval's requests -> token ids -> the scorer, as lm_eval's HF backend encodes them."""

        def __init__(self, scorer: Any, params: Any, info: dict[str, Any]):
            super().__init__()
            self.scorer, self.params, self.info = scorer, params, info
            self.tokens = scorer.tokenizer

        @property
        def eot_token_id(self) -> int:
            return self.tokens.eos_id

        @property
        def prefix_token_id(self) -> int:  # an empty context's: BOS, else EOS (HFLM's)
            return self.tokens.eos_id if self.tokens.bos_id is None else self.tokens.bos_id

        @property
        def max_length(self) -> int:
            return self.scorer.max_length

        def get_model_info(self) -> dict[str, Any]:
            return dict(self.info)

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
            return _encode(self.tokens, self.prefix_token_id, string, add_special_tokens)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            pairs = [_fitted(context, continuation, self.max_length)
                     for _, context, continuation in requests]  # fmt: skip
            answers = self.scorer.loglikelihoods(self.params, pairs)
            for (request, _, _), answer in zip(requests, answers, strict=True):
                if request is not None:
                    self.cache_hook.add_partial("loglikelihood", request, answer)
            return answers

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            windows = [_rolling_windows(self.tok_encode(r.args[0]), self.prefix_token_id,
                                        self.max_length) for r in requests]  # fmt: skip
            flat = [pair for pairs in windows for pair in pairs]
            answers = iter(self.scorer.loglikelihoods(self.params, flat))
            totals = [sum(next(answers)[0] for _ in pairs) for pairs in windows]
            for request, total in zip(requests, totals, strict=True):
                self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            texts: list[str] = [""] * len(requests)
            for indices in _by_generation_kwargs(requests):
                contexts = [requests[i].args[0] for i in indices]
                generated = _generate_texts(self, contexts, requests[indices[0]].args[1])
                for i, text in zip(indices, generated, strict=True):
                    texts[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
            return texts

    return ReplicatorLM


def _encode(tokens: Any, prefix_id: int, string: str, add_special_tokens: bool | None):
    """HFLM's ``tok_encode``: the tokenizer's own special tokens, unless the text already
    starts with the prefix token's text."""
    from lm_eval.models.utils import has_bos_prefix

    if add_special_tokens is None and has_bos_prefix(
        string, tokens.decode([prefix_id], skip_special_tokens=False)
    ):
        add_special_tokens = False
    return tokens.encode(string, add_special_tokens=add_special_tokens)


def _fitted(context: Sequence[int], continuation: Sequence[int], max_length: int):
    """A pair cut from the left to ``max_length + 1`` tokens, as HFLM cuts it (the
    continuation whole, at most ``max_length``)."""
    if len(continuation) > max_length:
        raise UsageError(
            f"a continuation of {len(continuation)} tokens is longer than the model's context "
            f"{max_length}"
        )
    whole = [*context, *continuation][-(max_length + 1) :]
    return whole[: len(whole) - len(continuation)], list(continuation)


def _rolling_windows(ids: list[int], prefix_id: int, max_length: int) -> list[tuple]:
    """lm_eval's disjoint rolling windows of a document (every token scored once, each
    with as much context as fits), as ``(context, continuation)`` pairs."""
    from lm_eval import utils as lm_utils

    windows = lm_utils.get_rolling_token_windows(
        token_list=ids, prefix_token=prefix_id, max_seq_len=max_length, context_len=1
    )
    return [lm_utils.make_disjoint_window(window) for window in windows]


def _by_generation_kwargs(requests: Sequence[Any]) -> list[list[int]]:
    """The requests' indices, grouped by their generation kwargs (a batch shares them)."""
    groups: dict[str, list[int]] = {}
    for i, request in enumerate(requests):
        key = json.dumps(request.args[1], sort_keys=True, default=str)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _generate_texts(lm: Any, contexts: list[str], gen_kwargs: dict) -> list[str]:
    """HFLM's ``generate_until`` for one group of requests: greedy, ``max_gen_toks`` new
    tokens at most after contexts cut to fit, the text cut at the first stop string."""
    from lm_eval.models.utils import (
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )

    kwargs = normalize_gen_kwargs(gen_kwargs, 256)  # HFLM's default max_gen_toks
    eos = lm.tokens.decode([lm.eot_token_id], skip_special_tokens=False)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    max_gen_toks = kwargs.pop("max_gen_toks")
    if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
        log.warning("eval --tasks generates greedily: ignoring %s", kwargs)
    room = lm.max_length - max_gen_toks
    if room < 1:
        raise UsageError(
            f"max_gen_toks={max_gen_toks} leaves no room for a context in the model's "
            f"{lm.max_length} tokens"
        )
    prompts = [lm.tok_encode(context)[-room:] for context in contexts]
    generated = lm.scorer.generate(lm.params, prompts, max_new_tokens=max_gen_toks, stop=until)
    return [postprocess_generated_text(lm.tokens.decode(ids), until, None) for ids in generated]
