"""The import layering of the source tree, read with `ast` (nothing is imported; docs/architecture.md, Layering):

- `llmctl.engine` imports nothing else of `llmctl` (it is a library the CLI, server and bench use);
- no library (`llmctl/` except `cli.py`, `engine/`, `checks/`) imports the CLI (`llmctl.cli`, `llmctl.commands`);
- module-level imports form no cycle (those inside functions or under `if TYPE_CHECKING:` run later, or never).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
CLI_MODULES = ("llmctl.cli", "llmctl.commands")


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module's dotted name
    target: str  # the deepest module of the source tree it names (or the dotted name itself, outside the tree)
    path: str  # the importing file, relative to the root
    line: int
    at_import_time: bool  # runs when the importer is imported (not inside a function, not under TYPE_CHECKING)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.target}"


def package_dirs(root: Path) -> dict[str, Path]:
    """pyproject's package-dir: each top package's dotted name and its folder."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    return {name: root / folder for name, folder in config["tool"]["setuptools"]["package-dir"].items()}


def source_modules(dirs: dict[str, Path]) -> dict[str, Path]:
    """Every module of the source tree by dotted name (a package by its `__init__.py`). A folder mapped to a
    package of its own is named by that mapping only, not also under the folder around it."""
    modules: dict[str, Path] = {}
    mapped = set(dirs.values())
    for package, folder in dirs.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder)
            if "__pycache__" in rel.parts or any(parent in mapped for parent in path.parents if folder in parent.parents):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(body: list[ast.stmt], at_import_time: bool):
    """(node, at_import_time) for every import statement under `body`: function bodies and TYPE_CHECKING blocks
    are not at import time (class bodies are)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, at_import_time
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _import_nodes(node.body, False)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.body, False)
            yield from _import_nodes(node.orelse, at_import_time)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    yield from _import_nodes([c for c in children if isinstance(c, ast.AST)], at_import_time)


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement loads (for `from X import a`: `X.a`, which is a module or a name
    of X; `deepest_module` tells which)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".")
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base]) if base else ".".join(anchor)
    return [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]


def deepest_module(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of `name` that is a module of the tree (`llmctl.engine.LLM` -> `llmctl.engine`)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return name


def collect_imports(root: Path, modules: dict[str, Path]) -> list[Import]:
    found = []
    for module, path in sorted(modules.items()):
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, at_import_time in _import_nodes(tree.body, True):
            for name in _imported_names(node, module, is_package):
                found.append(Import(module, deepest_module(name, modules), str(path.relative_to(root)), node.lineno,
                                    at_import_time))
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def engine_violations(imports: list[Import]) -> list[str]:
    return [str(imp) for imp in imports if _within(imp.importer, "llmctl.engine") and _within(imp.target, "llmctl")
            and not _within(imp.target, "llmctl.engine")]


def cli_violations(imports: list[Import]) -> list[str]:
    def is_library(module: str) -> bool:
        return _within(module, "llmctl") and not any(_within(module, cli) for cli in CLI_MODULES)

    return [str(imp) for imp in imports
            if is_library(imp.importer) and any(_within(imp.target, cli) for cli in CLI_MODULES)]


def import_cycles(imports: list[Import], modules: dict[str, Path]) -> list[list[Import]]:
    """Each cycle of import-time imports among the tree's modules, as its imports in order (one per strongly
    connected component, so a tangle is reported once)."""
    edges: dict[str, dict[str, Import]] = {module: {} for module in modules}
    for imp in imports:
        if imp.at_import_time and imp.target in modules and imp.target != imp.importer:
            edges[imp.importer].setdefault(imp.target, imp)
    cycles = []
    for component in _strongly_connected(edges):
        if len(component) > 1:
            cycles.append(_cycle_in(component, edges))
    return cycles


def _strongly_connected(edges: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (the tree is deep enough that recursion is a risk)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def _cycle_in(component: set[str], edges: dict[str, dict[str, Import]]) -> list[Import]:
    """One cycle through a strongly connected component: walk inside it until a module repeats."""
    path: list[str] = [min(component)]
    while True:
        nxt = min(target for target in edges[path[-1]] if target in component)
        if nxt in path:
            path = path[path.index(nxt):] + [nxt]
            return [edges[a][b] for a, b in zip(path, path[1:])]
        path.append(nxt)


def _tree_imports(root: Path) -> tuple[dict[str, Path], list[Import]]:
    modules = source_modules(package_dirs(root))
    return modules, collect_imports(root, modules)


def _format_cycles(cycles: list[list[Import]]) -> str:
    return "\n".join("import cycle: " + " -> ".join(str(imp) for imp in cycle) for cycle in cycles)


@pytest.fixture(scope="module")
def tree() -> tuple[dict[str, Path], list[Import]]:
    return _tree_imports(ROOT)


def test_the_engine_imports_nothing_else_of_llmctl(tree):
    _, imports = tree
    violations = engine_violations(imports)
    assert not violations, "llmctl.engine may import only llmctl.engine:\n" + "\n".join(violations)


def test_no_library_imports_the_cli(tree):
    _, imports = tree
    violations = cli_violations(imports)
    assert not violations, "libraries may not import llmctl.cli or llmctl.commands:\n" + "\n".join(violations)


def test_module_level_imports_form_no_cycle(tree):
    modules, imports = tree
    assert "llmctl.engine.model_runner" in modules and "llmctl.server.app" in modules  # the tree was found
    cycles = import_cycles(imports, modules)
    assert not cycles, _format_cycles(cycles)


def _write_tree(root: Path, files: dict[str, str]) -> None:
    (root / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "llmctl" = "llmctl", "llmctl.engine" = "engine", '
        '"llmctl.commands" = "commands" }\n')
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_rules_name_the_offending_module_and_import(tmp_path):
    """The checks on a small tree with one violation of each rule, and the imports they must let pass."""
    _write_tree(tmp_path, {
        "llmctl/__init__.py": "",
        "llmctl/cli.py": "import llmctl.commands.serve\n",
        "llmctl/server.py": "from llmctl.engine import LLM\n\ndef main():\n    from llmctl import cli\n",
        "commands/__init__.py": "",
        "commands/serve.py": "from llmctl.server import main\n",
        "engine/__init__.py": "",
        "engine/runner.py": "from llmctl.engine import steps\nfrom typing import TYPE_CHECKING\n"
                            "if TYPE_CHECKING:\n    from llmctl.engine.scheduler import Scheduler\n",
        "engine/steps.py": "from . import scheduler\n",
        "engine/scheduler.py": "import llmctl.engine.runner\n\ndef log():\n    import llmctl.server\n",
    })
    modules, imports = _tree_imports(tmp_path)
    assert engine_violations(imports) == ["engine/scheduler.py:4: llmctl.engine.scheduler imports llmctl.server"]
    assert cli_violations(imports) == ["llmctl/server.py:4: llmctl.server imports llmctl.cli"]
    assert _format_cycles(import_cycles(imports, modules)) == (
        "import cycle: engine/runner.py:1: llmctl.engine.runner imports llmctl.engine.steps -> "
        "engine/steps.py:1: llmctl.engine.steps imports llmctl.engine.scheduler -> "
        "engine/scheduler.py:1: llmctl.engine.scheduler imports llmctl.engine.runner")


def test_imports_in_functions_and_under_type_checking_make_no_cycle(tmp_path):
    _write_tree(tmp_path, {
        "llmctl/__init__.py": "",
        "engine/__init__.py": "",
        "engine/a.py": "import typing\nif typing.TYPE_CHECKING:\n    from llmctl.engine import b\nelse:\n    pass\n",
        "engine/b.py": "import llmctl.engine.a\n\nclass B:\n    def run(self):\n        from llmctl.engine.a import x\n",
    })
    modules, imports = _tree_imports(tmp_path)
    assert import_cycles(imports, modules) == []
    assert [str(imp) for imp in imports if imp.at_import_time and imp.target.startswith("llmctl")] == [
        "engine/b.py:1: llmctl.engine.b imports llmctl.engine.a"]
