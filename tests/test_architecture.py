"""The house rules of docs/architecture.md, read from the code's own imports: which package may import which, no
import cycle, one definition of each shared rule, and every command line behind the one contract.

Imports are read with ``ast`` (module level and inside functions alike, so a local import cannot hide an arrow
against the flow), never by importing the code.
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("storage", "config", "moe", "parallel", "data", "interop", "training", "analysis", "inference")
TOP = ("train", "launch")  # the scripts at the top, which may import everything
# analysis/ has two halves: planning (imports config, moe, parallel only) and router analysis (reads run directories)
ROUTER_ANALYSIS = {"analysis.router", "analysis.router_probe", "analysis.router_plots"}
# what each package (or half of one) may import of ours, beside itself; storage/ (atomic writes, file digests) is
# at the bottom beside config/: it imports nothing of ours, and every package but config/ may import it
ALLOWED = {
    "storage": set(),
    "config": set(),
    "moe": {"config", "storage"},
    "parallel": {"config", "moe", "storage"},
    "data": {"config", "storage"},
    "interop": {"config", "moe", "parallel", "storage"},
    "training": {"config", "moe", "parallel", "data", "storage"},
    "analysis": {"config", "moe", "parallel", "storage"},
    "inference": {"config", "moe", "parallel", "data", "interop", "storage"},
    "analysis/router": {"config", "moe", "parallel", "data", "interop", "training", "storage"},
}


def modules() -> dict[str, Path]:
    """Every module of ours by dotted name (``parallel`` for ``parallel/__init__.py``)."""
    found = {name: ROOT / f"{name}.py" for name in TOP}
    for package in PACKAGES:
        for path in (ROOT / package).glob("*.py"):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ours that ``path`` imports, anywhere in it (``from pkg import sub`` counts as ``pkg.sub``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in known:
                found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in known)
    return found


def graph() -> dict[str, set[str]]:
    every = modules()
    return {name: imports(path, set(every)) - {name} for name, path in every.items()}


def rule_of(module: str) -> str:
    return "analysis/router" if module in ROUTER_ANALYSIS else module.split(".")[0]


def test_the_rule_table_covers_every_package():
    assert set(PACKAGES) <= set(ALLOWED)
    assert all((ROOT / package / "__init__.py").is_file() for package in PACKAGES)


def test_every_import_follows_the_flow():
    wrong = []
    for module, targets in graph().items():
        if module in TOP:
            continue
        rule = rule_of(module)
        for target in targets:
            package = target.split(".")[0]
            if package in TOP or (package != module.split(".")[0] and package not in ALLOWED[rule]):
                wrong.append(f"{module} -> {target}")
            elif module.startswith("analysis.") and rule == "analysis" and target in ROUTER_ANALYSIS:
                wrong.append(f"{module} -> {target} (planning must not need router analysis)")
    assert not wrong, "imports against docs/architecture.md's rules:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = defaultdict(int)  # 0 unseen, 1 on the path, 2 done
    path: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges[node]):
            if state[target] == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif state[target] == 0:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if state[node] == 0:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def definitions(kind: type, name: str) -> list[str]:
    """Where a class or function (or a module-level assignment, for ``ast.Assign``) named ``name`` is defined."""
    places = []
    for module, path in modules().items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if kind is ast.Assign and isinstance(node, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    places.append(module)
            elif isinstance(node, kind) and node.name == name:
                places.append(module)
    return places


def test_one_definition_of_the_error_type_the_degrees_and_the_precision_rule():
    assert definitions(ast.ClassDef, "ConfigError") == ["config.errors"]
    assert definitions(ast.Assign, "DEGREES") == ["config.parallel"]
    assert definitions(ast.FunctionDef, "auto_precision") == ["parallel.hardware"]
    assert definitions(ast.FunctionDef, "require") == ["config.schema"]
    assert definitions(ast.FunctionDef, "_require") == []
    assert definitions(ast.FunctionDef, "resolve_layout") == ["parallel.layout"]


def test_one_home_of_atomic_writes_and_file_digests():
    for name in ("atomic_output", "atomic_folder", "write_text_atomic", "sha256_file", "fsync_dir"):
        assert definitions(ast.FunctionDef, name) == ["storage.files"], name
    for name in ("_write_json_atomic", "_file_digest", "_fsync_dir"):
        assert definitions(ast.FunctionDef, name) == [], name


def test_every_command_is_a_console_script_through_the_one_contract():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    every = modules()
    listed = {}
    for script, target in scripts.items():
        module, function = target.split(":")
        assert module in every, f"{script}: no module {module}"
        tree = ast.parse(every[module].read_text(encoding="utf-8"))
        assert function in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, f"{script}: {target}"
        listed[module] = script
    with_main = {module for module, path in every.items()
                 if any(isinstance(n, ast.FunctionDef) and n.name == "main"
                        for n in ast.parse(path.read_text(encoding="utf-8")).body)}
    assert with_main == set(listed), f"commands without a console script: {sorted(with_main - set(listed))}"
    for module in with_main:  # each ends through config/cli.py's run_command, which maps errors to exit statuses
        assert "run_command(" in every[module].read_text(encoding="utf-8"), f"{module}.main bypasses run_command"
