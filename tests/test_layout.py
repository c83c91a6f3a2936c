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


def test_the_library_does_not_import_the_trainer():
    library = [p for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    for path in library:
        assert not any(m.startswith("replicator.trainer") for m in imports_of(path)), path


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
