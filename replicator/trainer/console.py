"""What the terminal shows during ``train`` and ``eval``, and the log file for the rest.

The terminal gets replicator's own lines: its log records, its warnings, the
progress bar and the results. Everything else that the libraries underneath
write (tfds' progress bars and notices, Orbax's and absl's logging, Python
warnings, the C++ logs of XLA and TensorStore) goes to ``WORKDIR/log.txt``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Mapping
from typing import Any

from absl import logging as absl_logging

from replicator import storage
from replicator.errors import UserError


class Console:
    """Routes output for one command: replicator's to the terminal, the rest to a log.

    The process's stdout and stderr (file descriptors 1 and 2, so what C++ code
    prints too, e.g. gloo's connection notices) are redirected into a log file: a
    temporary one until `log_to` names the workdir's; results and the progress
    bar go to the terminal's stdout kept aside. With ``verbose`` nothing is
    redirected: the libraries print as they would.

    Args:
      verbose: leave the libraries' output on the terminal.
    """

    def __init__(self, verbose: bool):
        self.out, self.err = sys.stdout, sys.stderr
        self._log = None
        self._mirror: storage.Mirror | None = None  # the log's copy in a bucket
        self._created: str | None = None  # a workdir that log_to made
        handler = logging.StreamHandler(self.err)
        handler.setFormatter(logging.Formatter("%(message)s"))
        # Details for the log only: log.info(..., extra={"log_only": True}).
        handler.addFilter(lambda record: not getattr(record, "log_only", False))
        logger = logging.getLogger("replicator")
        logger.handlers = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False
        absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax's per-save INFO chatter
        if verbose:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        self.out = os.fdopen(os.dup(1), "w", buffering=1, errors="replace")
        self.err = os.fdopen(os.dup(2), "w", buffering=1, errors="replace")
        handler.setStream(self.err)
        self._log = tempfile.TemporaryFile("w+", buffering=1, errors="replace")
        self._redirect()
        sys.stdout = _LogStream(self, terminal=self.out)
        to_log = logging.StreamHandler(_LogStream(self, terminal=None))
        to_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(to_log)
        warnings.showwarning = self._show_warning
        import rich

        rich.reconfigure(file=self.out)  # the progress bar, on the terminal

    def set_process(self, process_index: int) -> None:
        """Only process 0 reports progress; the others show only warnings."""
        if process_index:
            logging.getLogger("replicator").setLevel(logging.WARNING)

    def log_to(self, workdir: str, process_index: int, command: str, *, create: bool) -> None:
        """Moves the log to ``WORKDIR/log.txt`` (``log.process_<i>.txt`` on process i > 0),
        appending, with what was logged so far; only into an existing workdir unless
        ``create``."""
        if self._log is None or not (create or storage.isdir(workdir)):
            return
        name = "log.txt" if process_index == 0 else f"log.process_{process_index}.txt"
        try:
            if storage.is_remote(workdir):  # no append in a bucket: a mirrored local copy
                if not storage.listdir(workdir):
                    self._created = workdir
                self._mirror = storage.Mirror(storage.join(workdir, name))
                path = self._mirror.local_path
            else:
                try:
                    os.makedirs(workdir)
                    self._created = workdir
                except FileExistsError:  # there already, or another process made it just now
                    pass
                path = os.path.join(workdir, name)
            log = open(path, "a", buffering=1, errors="replace")
        except OSError as e:
            logging.getLogger("replicator").warning("Cannot write a log in %s: %s", workdir, e)
            return
        log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} python -m replicator {command}\n")
        self._log.flush()
        self._log.seek(0)
        log.write(self._log.read())
        log.flush()
        self._log.close()
        self._log = log
        self._redirect()

    def discard_new_workdir(self) -> None:
        """Removes the workdir `log_to` made, if it holds nothing but this process's log:
        a command refused for a mistake in its input leaves nothing behind. (Other
        processes' logs stay, and with them the directory.)"""
        if self._created is None or self._log is None:
            return
        own = os.path.basename(self._log.name)
        if self._mirror is not None:
            try:
                if storage.listdir(self._created) in ([], [own]):
                    self._restore_terminal()
                    self._mirror.discard()
            except OSError:  # the bucket is gone or silent: nothing more to tidy
                pass
            return
        try:
            if os.listdir(self._created) == [own]:
                self._restore_terminal()
                os.remove(os.path.join(self._created, own))
                os.rmdir(self._created)
        except OSError:  # another process wrote there meanwhile: keep it
            pass

    def _restore_terminal(self) -> None:
        """The log is going: C++ output back to the terminal."""
        os.dup2(self.err.fileno(), 2)
        os.dup2(self.out.fileno(), 1)
        self._log.close()
        self._log = None

    def close(self) -> None:
        """Puts the log in the workdir's bucket, if it is in one (local logs need nothing)."""
        if self._mirror is not None:
            if self._log is not None:
                self._log.flush()
            self._mirror.close()

    def _redirect(self) -> None:
        os.dup2(self._log.fileno(), 1)  # stdout and stderr, C++ included, into the log
        os.dup2(self._log.fileno(), 2)

    def print(self, *values) -> None:
        """A result, on the terminal's stdout."""
        print(*values, file=self.out, flush=True)

    def report(self, error: BaseException, *, summary: str | None) -> None:
        """An error: on the terminal ``summary`` (one line), or the traceback when None.

        The log gets the traceback too, but for a `UserError` with a summary: a
        command refused for its input writes one line into a run's log, as on the
        terminal (with every item of a list the terminal shortens)."""
        text = "".join(traceback.format_exception(error))
        if summary is not None and isinstance(error, UserError):
            self._write_log(f"error: {one_line(str(error), items_shown=sys.maxsize)}\n")
        else:
            self._write_log(text)
        self.err.write(text if summary is None else summary + "\n")
        self.err.flush()

    def _write_log(self, text: str) -> None:
        if self._log is not None:
            self._log.write(text)

    def _show_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        self._write_log(warnings.formatwarning(message, category, filename, lineno, line))
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__") == "warnings":
            frame = frame.f_back
        caller = frame.f_globals.get("__name__", "") if frame is not None else ""
        if caller == "replicator" or caller.startswith("replicator."):
            self.err.write(f"warning: {message}\n")  # the library's advice to the user


def result_line(result: Mapping[str, Any], split: str) -> str:
    """An eval result as ``eval`` prints it for a person (``--json``: as JSON).

    >>> result_line({"step": 1200, "loss": 0.11276, "accuracy": 0.96111, "num_examples": 360},
    ...             "test")
    'test metrics of step 1200: loss 0.1128, accuracy 0.9611 (360 examples)'
    """
    shown = ", ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, float))
    examples = result.get("num_examples")
    return f"{split} metrics of step {result.get('step')}: {shown}" + (
        f" ({examples:,} examples)" if isinstance(examples, int) else ""
    )


def parallelism_line(config: Mapping[str, Any], mesh: Mapping[str, int]) -> str | None:
    """What a run splits beyond data parallelism, for its start: the pipeline, sequence
    and expert axes of ``mesh`` with the keys that shape them, and a mixture of experts
    (the LM's ``model.num_experts``), which else shows only in its ``dropped_fraction``.
    None when there is none of these.

    >>> parallelism_line({"context_strategy": "ring", "context_load_balance": True},
    ...                  {"data": 2, "context": 4})
    "parallelism: sequences split over 'context' (4 devices), attention 'ring', load-balanced"
    >>> parallelism_line({"model": {"num_experts": 8, "experts_per_token": 2}}, {"data": 8})
    'parallelism: a mixture of 8 experts (2 per token) in every block, experts replicated'
    """
    parts = []
    if mesh.get("stage", 1) > 1:
        microbatches = config.get("pipeline_microbatches") or mesh["stage"]
        repeats = config.get("pipeline_repeats") or 1
        parts.append(
            f"a pipeline of {mesh['stage']} stages over 'stage', {microbatches} microbatches"
            + (f", {repeats} repeats (circular)" if repeats > 1 else "")
        )
    if mesh.get("context", 1) > 1:
        balanced = ", load-balanced" if config.get("context_load_balance") else ""
        parts.append(
            f"sequences split over 'context' ({mesh['context']} devices), attention "
            f"{config.get('context_strategy', 'gather')!r}{balanced}"
        )
    model = config.get("model") or {}
    experts = model.get("num_experts") if isinstance(model, Mapping) else None
    if experts:
        every = model.get("moe_every") or 1
        where = "every block" if every == 1 else f"one block in {every}"
        capacity = model.get("expert_capacity_factor")
        split = mesh.get("expert", 1)
        parts.append(
            f"a mixture of {experts} experts ({model.get('experts_per_token', 1)} per token"
            + (f", capacity factor {capacity:g}" if capacity is not None else "")
            + f") in {where}, "
            + (f"split over 'expert' ({split} devices)" if split > 1 else "experts replicated")
        )
    return f"parallelism: {'; '.join(parts)}" if parts else None


def one_line(text: str, items_shown: int = 3) -> str:
    r"""A message as one line: a traceback's last line; a list's items joined by '; ',
    the first ``items_shown`` of them (the full list is in the log).

    >>> one_line("Invalid config:\n  - unknown key 'x'\n  - missing required key 'y'")
    "Invalid config: unknown key 'x'; missing required key 'y'"
    >>> one_line("Differs:\n  a\n  b\n  c\n  d\n  ... and 6 more", items_shown=2)
    'Differs: a; b; ... and 8 more'
    """
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    if any(line.startswith("Traceback") for line in lines):
        lines = lines[-1:]
    if not lines:
        return ""
    head, items = lines[0], [line.removeprefix("- ") for line in lines[1:]]
    more = re.fullmatch(r"\.\.\. and (\d+) more", items[-1]) if items else None
    hidden = int(more.group(1)) if more else 0
    items = items[:-1] if more else items
    hidden += max(len(items) - items_shown, 0)
    items = items[:items_shown] + ([f"... and {hidden} more"] if hidden else [])
    return head + (" " + "; ".join(items) if items else "")


class _LogStream:
    """A text stream into the console's log; ``isatty`` answers for ``terminal``."""

    def __init__(self, console: Console, *, terminal):
        self._console, self._terminal = console, terminal

    def write(self, text: str) -> int:
        self._console._write_log(text)
        return len(text)

    def flush(self) -> None:
        if self._console._log is not None:
            self._console._log.flush()

    def isatty(self) -> bool:
        return self._terminal is not None and self._terminal.isatty()

    def fileno(self) -> int:
        return self._console._log.fileno()
