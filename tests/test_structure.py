"""The layout's rules, checked on the source: no import cycles (function-level imports count), no module importing
another module's private name, no function much longer than a screen, and one list of dependencies."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lssp"
LONGEST_FUNCTION = 90  # lines, docstring included


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def absolute(path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative ones (``from .kv import``) resolved against ``path``."""
    if not node.level:
        return node.module or ""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) for every ``import lssp...`` and ``from lssp... import ...`` anywhere in ``path``, relative
    imports included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("lssp")]
        elif isinstance(node, ast.ImportFrom) and absolute(path, node).startswith("lssp"):
            found.append((absolute(path, node), [alias.name for alias in node.names]))
    return found


def edges(name: str) -> set[str]:
    """The lssp modules ``name`` imports (a name that is a submodule counts as that module)."""
    out = set()
    for module, names in imports(MODULES[name]):
        for imported in names:
            if f"{module}.{imported}" in MODULES:
                out.add(f"{module}.{imported}")
            elif module in MODULES:
                out.add(module)
        if not names and module in MODULES:
            out.add(module)
    out.discard(name)
    return out


def subpackage(name: str) -> str:
    return ".".join(name.split(".")[:2])


def cycles(level: str = "module") -> list[list[str]]:
    """Every strongly connected group of more than one module, or of subpackages (``lssp.decoding``, …) (Tarjan)."""
    graph = {name: edges(name) for name in MODULES}
    if level == "subpackage":
        grouped: dict[str, set[str]] = {}
        for name, targets in graph.items():
            grouped.setdefault(subpackage(name), set()).update(subpackage(t) for t in targets)
        graph = {name: targets - {name} for name, targets in grouped.items()}
    index, low, stack, on_stack, groups, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return groups


def test_no_import_cycles_between_modules():
    assert cycles() == []


def test_no_import_cycles_between_subpackages():
    assert cycles("subpackage") == []


def test_relative_imports_count(tmp_path, monkeypatch):
    a = tmp_path / "lssp" / "fake" / "a.py"
    a.parent.mkdir(parents=True)
    a.write_text("from .b import f\nfrom ..other import g\n")
    monkeypatch.setattr("test_structure.ROOT", tmp_path)
    assert imports(a) == [("lssp.fake.b", ["f"]), ("lssp.other", ["g"])]


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from lssp.fake import b\n")
    b.write_text("def f():\n    import lssp.fake.a\n")
    monkeypatch.setitem(MODULES, "lssp.fake.a", a)
    monkeypatch.setitem(MODULES, "lssp.fake.b", b)
    assert ["lssp.fake.a", "lssp.fake.b"] in cycles()


def test_no_module_imports_another_modules_private_name():
    offences = [f"{name} imports {module}.{imported}" for name, path in MODULES.items() for module, names in imports(path)
                for imported in names if imported.startswith("_") and not imported.startswith("__") and module != name]
    assert offences == []


def test_no_function_is_much_longer_than_a_screen():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > LONGEST_FUNCTION:
                    long.append(f"{name}.{node.name}: {length} lines")
    assert long == []


def test_the_layers_import_downwards_only():
    """Each layer imports only the layers below it."""
    above = {"lssp.decoding": ("lssp.drafters", "lssp.engines", "lssp.measure", "lssp.cli"),
             "lssp.drafters": ("lssp.engines", "lssp.measure", "lssp.cli"),
             "lssp.models": ("lssp.decoding", "lssp.drafters", "lssp.engines", "lssp.measure", "lssp.cli"),
             "lssp.engines": ("lssp.measure", "lssp.cli"), "lssp.measure": ("lssp.cli",)}
    offences = [f"{name} -> {target}" for name in MODULES for target in edges(name)
                for layer, forbidden in above.items() if name.startswith(layer + ".") and target.startswith(forbidden)]
    assert offences == []


def _requirement_names(lines: list[str]) -> dict[str, str]:
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            found[re.split(r"[<>=!~ \[]", line, maxsplit=1)[0].lower()] = line.replace(" ", "")
    return found


def test_pyproject_and_requirements_list_the_same_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _requirement_names(project["dependencies"] + project["optional-dependencies"]["test"])
    assert declared == _requirement_names((ROOT / "requirements.txt").read_text().splitlines())


def test_the_readme_headline_block_is_what_tables_py_generates_from_the_results():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    generated = tables.headline(ROOT / "benchmarks" / "results")
    assert re.search(r"\| stories \| SSp[^|]* \| 3 \|", generated)  # the run's rows, not an empty block
    assert tables.readme_block((ROOT / "README.md").read_text()) == generated


def test_the_readme_stays_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}"


ENGINE_NAMES = {"ours", "hf", "vllm", "llamacpp"}


def test_commands_and_measurements_never_branch_on_an_engines_name_or_class():
    """``lssp/cli`` and ``lssp/measure`` ask engines what they can do (class attributes, ``describe``) and start them
    through one registry (``cli/loaders.STARTERS``): no comparison with an engine's name, no lookup by a literal
    name, no ``isinstance`` on an engine or drafter class."""
    offences = []
    for name, path in MODULES.items():
        if not name.startswith(("lssp.cli.", "lssp.measure.")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                named = [c for side in (node.left, *node.comparators) for c in ast.walk(side)
                         if isinstance(c, ast.Constant) and c.value in ENGINE_NAMES]
                if named:
                    offences.append(f"{name}:{node.lineno} compares with {named[0].value!r}")
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                    and node.slice.value in ENGINE_NAMES:
                offences.append(f"{name}:{node.lineno} looks up {node.slice.value!r}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                classes = [c.id for c in ast.walk(node.args[1]) if isinstance(c, ast.Name)]
                if any(c.endswith(("Engine", "Drafter", "Head", "Rows")) for c in classes):
                    offences.append(f"{name}:{node.lineno} isinstance on {classes}")
    assert offences == []
