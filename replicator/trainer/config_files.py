"""Which config a command runs: the ``--config`` file, or a run's saved one.

``train`` reads the config file named by ``--config FILE[:MODE]``; ``eval`` starts
from the run's own ``WORKDIR/config.json`` when there is one. Either way the
command line's ``--config.KEY=VALUE`` overrides go on top, type-checked by
ml_collections against the keys of the config they apply to. A mistake in any of
this (a missing file, an unknown key, a value of the wrong type, a workdir that
holds another experiment) is a `UsageError` or a `ConfigError`, in one line.

A config file is read by `read_config_file`: its ``get_config()`` returns an
``ml_collections.ConfigDict`` (a plain dict is taken as one), to which the keys
its experiment declares are added at their defaults (`config_lib.complete`), so
that ``--config.model.num_experts=4`` or ``--config.mesh.stage=2`` is an override
like any other; a key that is still unknown is one line with the closest key, or
the experiment beside that declares it. A file that is not
there, does not compile, fails on import, has no ``get_config``, calls it with
the wrong arguments or returns something else is one line naming the file. An
exception in the file's own code is the user's bug, not replicator's: the line
names the exception and the file:line where it was raised, and ``--debug`` (or
``REPLICATOR_DEBUG=1``) prints the traceback. A `UserError` raised by the file
(``base_config``'s unknown mode) is shown as it is.

A dict or tuple key takes a Python literal on the command line, and the
``dict(k=v, ...)`` that config files write too: `write_overrides_as_literals`
reads it with `ast` (literal values only, nothing is evaluated).

Code beside a config file is found: the ``--config`` file's directory goes
first on ``sys.path`` (as Python does for a script's directory) before the file
is read, so ``experiment='my_task'`` and ``dataset='my_data:make_source'`` name
modules next to it, wherever it is. A module that cannot be found is one line
that says where modules are looked for (`check_importable`).
"""

from __future__ import annotations

import ast
import difflib
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import re
import sys
import sysconfig
import traceback
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

from replicator import storage
from replicator.errors import ConfigError, UsageError, UserError
from replicator.trainer import config as config_lib
from replicator.trainer.console import one_line
from replicator.trainer.experiment import declared_beside

FLAGS = flags.FLAGS
HELP = ("-h", "--help", "-help", "--helpshort", "help")

CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Experiment config file, e.g. configs/digits_cnn.py[:smoke]; eval: the run's "
    "WORKDIR/config.json is used when it exists.",
    lock_config=True,
)
_file_given = True  # False once eval made WORKDIR/config.json the --config flag


class _ConfigFileParser(flags.ArgumentParser):
    """In place of ml_collections' parser of ``--config FILE[:MODE]``: the file read
    by `read_config_file` (whose errors absl wraps; `flag_error` unwraps them)."""

    def parse(self, argument: str) -> ml_collections.ConfigDict:
        file, colon, mode = argument.partition(":")
        return read_config_file(file, *([mode] if colon else []))

    def flag_type(self) -> str:
        return "config object"


FLAGS["config"].parser = _ConfigFileParser()

log = logging.getLogger("replicator")


def file_given() -> bool:
    """Whether ``--config`` is a config file (else the run's saved config)."""
    return _file_given


def use_the_runs_config(argv: list[str]) -> None:
    """eval without --config: makes the flag the run's saved config, so that
    ``--config.key=value`` overrides apply to it, type-checked."""
    global _file_given
    workdir = argv_value(argv, "workdir")
    if argv_value(argv, "config") is not None or workdir is None:
        return
    from replicator.trainer.evaluator import run_config

    storage.check_bucket(workdir)  # "no such bucket" rather than "no config.json"
    saved = run_config(workdir)
    if saved is None:
        if any(arg in HELP for arg in argv):
            return
        if not storage.isdir(workdir):
            raise UsageError(f"--workdir {workdir} does not exist (a mistyped path?)")
        raise UsageError(
            f"{saved_path(workdir)} does not exist (not a training run's workdir?); "
            "pass --config FILE"
        )
    help_text = FLAGS["config"].help
    delattr(FLAGS, "config")
    sys.argv = [a for a in argv if a not in HELP]
    try:  # the overrides are parsed here, against the saved config's keys and types
        config_flags.DEFINE_config_dict("config", saved, help_text, lock_config=True)
    except Exception as e:  # noqa: BLE001  (ml_collections raises many kinds)
        raise flag_error(e, argv) from e
    _file_given = False


def check_config_file(argv: list[str]) -> None:
    """A ``--config`` file that does not exist, in one line (before absl reads it);
    an existing one's directory becomes importable (`import_beside_config`)."""
    value = argv_value(argv, "config")
    if value is not None and _file_given:
        path = value.split(":", 1)[0]
        _check_is_file(path)
        import_beside_config(path)


def _check_is_file(path: str) -> None:
    if os.path.isdir(path):
        raise ConfigError(f"config file {path!r} is a directory; give the config's .py file")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")


def import_beside_config(path: str) -> None:
    """Puts the directory of config file ``path`` first on ``sys.path``, so that the
    modules beside it (an experiment, a data function, a tfds builder) import by
    their plain names, as those beside a script do."""
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.insert(0, directory)


def read_config_file(path: str, *args: str) -> ml_collections.ConfigDict:
    """The config that ``get_config(*args)`` in the Python file ``path`` returns, locked.

    Args:
      path: the config file.
      *args: what follows the colon in ``--config FILE:MODE`` (nothing if no colon).

    Returns:
      ``get_config``'s ``ml_collections.ConfigDict``; a dict becomes one.

    Raises:
      ConfigError: in one line naming the file and what is wrong with it, for an
        exception in the file's code with the file:line it was raised at (chained
        to it, for ``--debug``). A `UserError` the file raises is left as it is.

    >>> read_config_file("configs/digits_cnn.py", "smoke").num_train_steps
    4
    """
    module = _load_config_module(path)
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ConfigError(
            f"config file {path!r} defines no get_config(); a config file's "
            "get_config() returns an ml_collections.ConfigDict"
        )
    _check_arguments(path, get_config, args)
    try:
        config = get_config(*args)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  (the user's code: any bug at all)
        raise ConfigError(f"config file {path!r}: get_config() raised {_described(e)}") from e
    if isinstance(config, dict) or type(config) is ml_collections.FrozenConfigDict:
        config = ml_collections.ConfigDict(config)
    if not isinstance(config, ml_collections.ConfigDict):
        shown = (
            "None (no return statement?)"
            if config is None
            else f"a {type(config).__name__!r} object"
        )
        raise ConfigError(
            f"config file {path!r}: get_config() returned {shown}, not a config; "
            "it must return an ml_collections.ConfigDict (or a dict)"
        )
    _complete(config, path)
    config.lock()
    return config


def _complete(config: ml_collections.ConfigDict, path: str) -> None:
    """The experiment's keys added to ``config`` (`config_lib.complete`), so that the
    command line can override each; an experiment that fails to import, in one line."""
    try:
        config_lib.complete(config)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  (the experiment's code: any bug at all)
        raise ConfigError(
            f"config file {path!r}: config.experiment={config.get('experiment')!r} failed to "
            f"import: {_described(e)}"
        ) from e


def _load_config_module(path: str) -> Any:
    _check_is_file(path)
    # ml_collections' own name for the module; in sys.modules, as dataclasses need.
    loader = importlib.machinery.SourceFileLoader("config_config", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    sys.modules[loader.name] = module
    try:
        loader.exec_module(module)
    except SyntaxError as e:
        where = f"{_shown_path(e.filename or path)}:{e.lineno}"
        raise ConfigError(
            f"config file {path!r} is not valid Python: {type(e).__name__} at {where}: {e.msg}"
        ) from e
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  (the user's code: any bug at all)
        raise ConfigError(f"config file {path!r} failed to import: {_described(e)}") from e
    return module


def _check_arguments(path: str, get_config: Any, args: tuple[str, ...]) -> None:
    """`get_config` called with what the colon gave, or one line saying how to call it."""
    try:
        signature = inspect.signature(get_config)
    except (TypeError, ValueError):
        return  # not introspectable: the call itself says
    try:
        signature.bind(*args)
        return
    except TypeError:
        pass
    if not args:
        problem = f"get_config{signature} needs an argument: give it after a colon, "
        raise ConfigError(f"config file {path!r}: {problem}--config {path}:VALUE")
    try:
        signature.bind()
    except TypeError:
        raise ConfigError(
            f"config file {path!r}: get_config{signature} cannot take the one argument "
            f"after the colon ({args[0]!r})"
        ) from None
    raise ConfigError(
        f"config file {path!r} has no modes (get_config() takes no argument): drop ':{args[0]}'"
    )


def _described(error: BaseException) -> str:
    """``NameError at configs/x.py:12 in get_config: ... (--debug shows the traceback)``:
    the location is the innermost frame in the user's code (not replicator's or a
    library's)."""
    where = ""
    for frame in traceback.extract_tb(error.__traceback__):
        if _is_users_code(frame.filename):
            scope = "" if frame.name == "<module>" else f" in {frame.name}"
            where = f" at {_shown_path(frame.filename)}:{frame.lineno}{scope}"
    return f"{type(error).__name__}{where}: {one_line(str(error))} (--debug shows the traceback)"


_NOT_USERS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # replicator itself
    *{sysconfig.get_paths()[name] for name in ("stdlib", "purelib", "platlib")},
)


def _is_users_code(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    filename = os.path.abspath(filename)
    return not any(filename.startswith(os.path.join(top, "")) for top in _NOT_USERS)


def _shown_path(filename: str) -> str:
    """A path as short as it is clear: relative when under the working directory."""
    relative = os.path.relpath(os.path.abspath(filename))
    return filename if relative.startswith("..") else relative


def check_importable(config: ml_collections.ConfigDict, workdir: str) -> None:
    """The config's experiment, and its dataset's module where it names one
    (``'module:function'``), can be found; else one line saying where modules are
    looked for and what to set."""
    names = [("experiment", config.get("experiment"))]
    dataset = config.get("dataset")
    if isinstance(dataset, str) and ":" in dataset:
        from replicator.trainer.data import user_sources

        if user_sources.is_user_source(dataset) and not dataset.startswith(
            user_sources.ARRAY_RECORD
        ):
            names.append(("dataset", dataset))
    for key, value in names:
        if not isinstance(value, str) or not value:
            continue  # the config's validation names it
        module = value.split(":", 1)[0].split(".")[0]
        if not re.fullmatch(r"[A-Za-z_]\w*", module) or importlib.util.find_spec(module):
            continue
        if _file_given:
            config_file = FLAGS["config"].config_filename.split(":", 1)[0]
            config_dir = os.path.dirname(os.path.abspath(config_file))
            where = f"beside the config file ({config_dir}), in the working directory"
            fix = f"put {module} there, or add its directory to PYTHONPATH"
        else:
            where = f"in the working directory (eval read the run's {saved_path(workdir)})"
            fix = (
                "pass the run's config file with --config FILE (its directory is "
                f"searched), or add {module}'s directory to PYTHONPATH"
            )
        raise ConfigError(
            f"config.{key}={value!r} cannot be imported: no module {module!r} {where} "
            f"or on PYTHONPATH; {fix}"
        )


_NULLED: list[str] = []  # keys given as --config.KEY=None (see `take_nulled`)


def take_nulled(argv: list[str]) -> list[str]:
    """``argv`` without its ``--config.KEY=None`` (``KEY`` may be nested: ``model.mlp_dim``),
    which `config_for` then sets to None: ml_collections cannot parse None for a key of
    another type (``ema_decay`` is a float, or None for no EMA); `config_lib.validate`
    says whether the key may be None.

    >>> take_nulled(["train", "--config.ema_decay=None", "--config.seed=1"]), _NULLED
    (['train', '--config.seed=1'], ['ema_decay'])
    >>> _ = take_nulled([])  # (and none again)
    """
    _NULLED.clear()
    kept = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return kept + argv[i:]
        nulled = re.fullmatch(r"--?config\.([\w.]+)=None", arg)
        if nulled:
            _NULLED.append(nulled.group(1))
        else:
            kept.append(arg)
    return kept


def _set_nulled(config: ml_collections.ConfigDict) -> None:
    """Sets each `take_nulled` key of ``config`` to None; one that it lacks, in one line."""
    for key in _NULLED:
        *parents, last = key.split(".")
        node = config
        for part in parents:
            node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
        if not isinstance(node, ml_collections.ConfigDict) or last not in node:
            raise _unknown_key(last, [*sys.argv, f"--config.{key}=None"])
        node[last] = None


def write_overrides_as_literals(argv: list[str]) -> list[str]:
    """``argv`` with each ``--config.KEY=dict(a=1, ...)`` written as the literal
    ``{'a': 1, ...}`` that ml_collections parses (config files and the guide write
    dicts both ways); a dict or tuple key whose value is no such literal is a
    `UsageError` that shows the forms it takes.

    >>> write_overrides_as_literals(["train", "--config.optimizer_args=dict(b1=0.9, b2=0.95)"])
    ['train', "--config.optimizer_args={'b1': 0.9, 'b2': 0.95}"]
    """
    kept = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return kept + argv[i:]
        override = re.fullmatch(r"(--?config\.([\w.]+))=(.*)", arg, re.S)
        if override:
            flag, key, text = override.groups()
            arg = _as_literal(flag, key, text)
        kept.append(arg)
    return kept


_NO_LITERAL = object()


def _as_literal(flag: str, key: str, text: str) -> str:
    types = config_lib.SCHEMA[key][0] if key in config_lib.SCHEMA else ()
    if str in types and dict not in types:
        return f"{flag}={text}"  # a path, a regex, a name: whatever it says
    try:
        tree = ast.parse(text.strip(), mode="eval")
        value = _literal_value(tree.body)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        tree, value = None, _NO_LITERAL
    expected = _expected_literal(key)
    if expected and not isinstance(value, expected[0]):
        raise UsageError(
            f"{flag}={text} is not {expected[1]}; write a Python literal, e.g. "
            f"{_literal_examples(key)}"
        )
    if tree is None or not any(isinstance(node, ast.Call) for node in ast.walk(tree)):
        return f"{flag}={text}"
    return f"{flag}={value!r}"


def _literal_value(node: ast.expr) -> Any:
    """A literal's value, ``dict(k=v, ...)`` read as ``{'k': v, ...}``; never evaluated."""
    if isinstance(node, ast.Call):
        if not (isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args):
            raise ValueError("only dict(key=value, ...) calls")
        if any(keyword.arg is None for keyword in node.keywords):
            raise ValueError("no **")
        return {keyword.arg: _literal_value(keyword.value) for keyword in node.keywords}
    if isinstance(node, ast.Dict):
        if None in node.keys:
            raise ValueError("no **")
        return {_literal_value(k): _literal_value(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_literal_value(item) for item in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    return ast.literal_eval(node)


def _expected_literal(key: str) -> tuple[tuple[type, ...], str] | None:
    """The types a top-level key's override must read as, where a str is never right
    (a key that is None by default: ml_collections would keep a str as it is)."""
    if key not in config_lib.SCHEMA:
        return None
    types, default, _ = config_lib.SCHEMA[key]
    if str in types:
        return None
    if dict in types:
        return (dict,), "a dict"
    if tuple in types and default is None:
        return (tuple, list), "a tuple"
    return None


def _literal_examples(key: str) -> str:
    """How to write ``key`` on the command line, from its meaning's own example."""
    meaning = config_lib.SCHEMA[key][2]
    dict_key = dict in config_lib.SCHEMA[key][0]
    for example in re.findall(r"e\.g\. (\{[^}]*\}|\(.*?\),\))", meaning):
        try:
            value = ast.literal_eval(example)
            break
        except (SyntaxError, ValueError):
            continue
    else:
        value = {"key": 1} if dict_key else (("regex", "value"),)
    literal = f'--config.{key}="{value!r}"'
    if not dict_key:
        return f"{literal} (a tuple of one pair ends with a comma)"
    if all(isinstance(name, str) and name.isidentifier() for name in value):
        call = ", ".join(f"{name}={item!r}" for name, item in value.items())
        return f'--config.{key}="dict({call})" or {literal}'
    return literal


def config_for(command: str, workdir: str) -> ml_collections.ConfigDict:
    """train: the config file with its overrides. eval: the run's saved config with the
    command line's overrides on top (the file's only when the run saved none)."""
    config, note = _resolve(command, workdir)
    _set_nulled(config)
    check_importable(config, workdir)  # before the note: a mistake stays one line
    if note:
        log.info("%s", note)
    return config


def _resolve(command: str, workdir: str) -> tuple[ml_collections.ConfigDict, str]:
    """The config, and for eval (and sample) the line that says which one it is."""
    config = FLAGS.config
    if command not in ("eval", "sample") or not _file_given:
        if command in ("eval", "sample"):
            return config, f"{command}: the run's config {saved_path(workdir)}{overrides_text()}"
        return config, ""
    from replicator.trainer.evaluator import run_config

    saved = run_config(workdir)
    file = FLAGS["config"].config_filename
    if saved is None:
        return config, f"{command}: the config {file} ({workdir} has none saved){overrides_text()}"
    overrides = config_flags.get_override_values(FLAGS["config"])
    saved.lock()  # an override names a key of the run's config
    try:
        saved.update_from_flattened_dict(overrides)
    except (TypeError, KeyError, AttributeError) as e:
        raise UsageError(f"cannot apply{overrides_text()} to the run's config: {e}") from e
    ignored = [
        d.split(":")[0]
        for d in config_lib.config_differences(saved.to_dict(), config.to_dict())
        if d.split(":")[0] not in overrides
    ]
    differs = f"; {file} differs in {', '.join(ignored)}, not used" if ignored else ""
    return saved, f"{command}: the run's config {saved_path(workdir)}{overrides_text()}{differs}"


def check_workdir(config: ml_collections.ConfigDict, workdir: str, *, force: bool) -> None:
    """Refuses a workdir whose run trained another experiment or model (unless ``force``)."""
    saved = config_lib.read_saved(workdir)
    if saved is None or force:
        return
    keys = [key for key in ("experiment", "model") if key in config]  # the rest: validate's
    current = config.to_dict()
    # A key the run's config lacks came with a newer config file: no change unless
    # overridden now (a different state would not restore anyway, with its own error).
    overridden = {*config_flags.get_override_values(FLAGS["config"]), *_NULLED}
    changes = config_lib.config_differences(
        {k: saved.get(k) for k in keys},
        {k: current.get(k) for k in keys},
        added_ok=lambda key: not any(o == key or o.startswith(f"{key}.") for o in overridden),
    )
    if changes:
        raise UsageError(
            f"{workdir} holds a run of another experiment ({'; '.join(changes)}); "
            "use another --workdir, or --force to train there anyway"
        )


def config_source(workdir: str | None) -> str:
    """Where ``--config`` came from: the file, or the run's saved config."""
    return FLAGS["config"].config_filename if _file_given else saved_path(workdir or "WORKDIR")


def saved_path(workdir: str) -> str:
    return storage.join(workdir, "config.json")


def overrides_text() -> str:
    """`` with --config.a=1 --config.b=2``: the command line's overrides ('' if none)."""
    overrides = config_flags.get_override_values(FLAGS["config"])
    shown = " ".join(
        [f"--config.{k}={v}" for k, v in overrides.items()]
        + [f"--config.{k}=None" for k in _NULLED]
    )
    return f" with {shown}" if shown else ""


def argv_value(argv: list[str], name: str) -> str | None:
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


def flag_error(error: BaseException, argv: list[str]) -> UserError:
    """A flag parser's error (or a config file's), as one line; a `UserError` that the
    config file raised (an unknown mode, say) as the first one raised."""
    cause, raised = error, None
    while cause is not None:  # ml_collections re-raises the file's error with its traceback
        raised = cause if isinstance(cause, UserError) else raised
        cause = cause.__cause__ or cause.__context__
    if raised is not None:
        return raised
    text = str(error)
    if isinstance(error, (AttributeError, KeyError)):
        unknown = re.search(r'Did you mean "([^"]+)" instead of "([^"]+)"', text)
        if unknown:
            return _unknown_key(unknown.group(2), argv, unknown.group(1))
        named = re.fullmatch(r"""["']*([\w.]+)["']*""", text.strip())
        if named:
            return _unknown_key(named.group(1), argv)
        return UsageError(f"unknown config key: {one_line(text)}")
    return _override_error(text) or UsageError(one_line(text))


def _unknown_key(key: str, argv: list[str], close: str | None = None) -> UsageError:
    """One line for an override naming no key: the key's whole dotted name (ml_collections
    names its last part only), and the closest key there is, or the experiment beside
    the config's that has it (a key of the LM's given to the classifiers)."""
    prefix = ""
    for arg in argv:
        path = re.match(r"-?-config\.([\w.]+)", arg)
        if path and path.group(1).split(".")[-1] == key:
            prefix = path.group(1)[: -len(key)]
    parent = prefix.rstrip(".")
    config = _config_of_the_file(argv)
    known = _keys_under(config, parent)
    experiment = config.get("experiment") if config is not None else None
    if isinstance(experiment, str) and parent in ("", "mesh"):
        field = "mesh_axes" if parent else "options"
        owners = declared_beside(experiment, key, field)
        if owners:
            what = "mesh axis" if parent else "key"
            return UsageError(
                f"unknown config key {prefix + key!r}: {experiment} has no {what} {key!r}; "
                f"{', '.join(owners)} has"
            )
    if close is None:
        matches = difflib.get_close_matches(key, known, n=1)
        close = matches[0] if matches else None
        if close is None and known:
            where = f"config.{parent}" if parent else "the config"
            return UsageError(
                f"unknown config key {prefix + key!r} ({where} has {', '.join(sorted(known))})"
            )
    hint = f" (did you mean {prefix + close!r}?)" if close else ""
    return UsageError(f"unknown config key {prefix + key!r}{hint}")


def _config_of_the_file(argv: list[str]) -> ml_collections.ConfigDict | None:
    """The ``--config`` file's config, with its experiment's keys, or None if unreadable."""
    value = argv_value(argv, "config")
    if value is None:
        return None
    path, colon, mode = value.partition(":")
    try:
        return read_config_file(path, *([mode] if colon else []))
    except Exception:  # noqa: BLE001  (a hint only: the error line stands without it)
        return None


def _keys_under(config: ml_collections.ConfigDict | None, parent: str) -> list[str]:
    """The keys under the dotted ``parent`` of ``config`` ([] if there are none)."""
    for part in filter(None, parent.split(".")):
        config = config.get(part) if isinstance(config, ml_collections.ConfigDict) else None
    return list(config.keys()) if isinstance(config, ml_collections.ConfigDict) else []


def _override_error(text: str) -> UsageError | None:
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
    untyped = re.search(r"Type <class 'NoneType'> of field config\.([\w.]+) is not supported", text)
    if untyped:
        key = untyped.group(1)
        return UsageError(
            f"config.{key} is None in the config file, with no type to read --config.{key} "
            "as; in the file, start from base_config() (whose keys all have one) or set it to "
            "ml_collections.config_dict.placeholder(TYPE)"
        )
    literal = re.search(r"--config\.([\w.]+)=.*Failed to parse '(.*)' as a ConfigDict", text)
    if literal:
        key, value = literal.groups()
        return UsageError(
            f"cannot read {value!r} as a dict: write a Python literal, e.g. "
            f"""--config.{key}="dict(key=1)" or --config.{key}="{{'key': 1}}", """
            f"or set one key, e.g. --config.{key}.KEY=VALUE"
        )
    return None


def parse_for_help(argv: list[str]) -> None:
    """Parses the flags that were given with ``--help``, to show a config's values."""
    rest = [a for a in argv if a not in HELP]
    value = argv_value(rest, "config")
    if value is not None:
        _check_is_file(value.split(":", 1)[0])
    if value is not None and _file_given:
        import_beside_config(value.split(":", 1)[0])
    sys.argv = rest
    try:
        FLAGS(rest)
    except Exception as e:  # noqa: BLE001  (absl's and the config file's own errors)
        raise flag_error(e, argv) from e
    if FLAGS["config"].value is not None:
        _set_nulled(FLAGS["config"].value)
