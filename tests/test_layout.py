"""The house: the library, the trainer and the runtime, with arrows one way."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "replicator"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (function bodies too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = {m for m in imports_of(path) if m in modules and m != name}
        # A package's __init__ importing its own submodules is not an arrow back.
        edges[name] = {t for t in targets if not name.startswith(t + ".")}
    return edges


def test_the_library_never_imports_experiments():
    for path in PACKAGE.rglob("*.py"):
        assert not any(m.split(".")[0] == "experiments" for m in imports_of(path)), path


def test_no_import_cycles():
    edges = graph()
    done, on_stack = set(), []

    def visit(node):
        if node in on_stack:
            cycle = on_stack[on_stack.index(node) :] + [node]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        on_stack.append(node)
        for target in sorted(edges[node]):
            # `import a.b.c` also runs a and a.b: count the deepest module only.
            visit(target)
        on_stack.pop()
        done.add(node)

    for node in sorted(edges):
        visit(node)


LAYERS = ("trainer", "runtime")  # on top of (trainer) and beside (runtime) the library


def library_modules() -> list[pathlib.Path]:
    """The SPMD library: every module outside the trainer and the runtime."""
    return [
        p
        for p in PACKAGE.rglob("*.py")
        if p.relative_to(PACKAGE).parts[0] not in LAYERS
        and p.name != "__main__.py"
        and p != PACKAGE / "__init__.py"
    ]


def test_the_library_does_not_import_the_trainer():
    for path in library_modules():
        assert not any(m.startswith("replicator.trainer") for m in imports_of(path)), path


def test_the_library_sits_in_folders_by_concern():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "errors.py", "replicator.py", "storage.py"]
    for folder in ("spmd", "step", "parallel", "attention", "checkpoints", "compiled"):
        assert (PACKAGE / folder / "__init__.py").exists(), folder


def _definitions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node, node.end_lineno - node.lineno + 1


def test_every_room_is_small():
    """A module at most 700 lines, a function 80, a class 400, the facade 300: in the
    library, the trainer, the runtime and the experiments."""
    too_big = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "experiments").rglob("*.py")]):
        source = path.read_text()
        name = path.relative_to(ROOT)
        if source.count("\n") > 700:
            too_big.append(f"{name}: {source.count(chr(10))} lines")
        for node, lines in _definitions(ast.parse(source)):
            limit = 80 if not isinstance(node, ast.ClassDef) else 400
            if node.name == "Replicator":
                limit = 300
            if lines > limit:
                too_big.append(f"{name}: {node.name} is {lines} lines (limit {limit})")
    assert not too_big, "\n".join(too_big)


def test_private_jax_only_in_the_compatibility_module():
    for path in PACKAGE.rglob("*.py"):
        if path.name == "compat.py":
            continue
        assert "._src" not in path.read_text(), path  # JAX's, Orbax's: no private module


def test_the_driver_fits_one_screen():
    source = (PACKAGE / "trainer" / "driver.py").read_text()
    tree = ast.parse(source)
    (loop,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_train"]
    assert loop.end_lineno - loop.lineno + 1 <= 80
