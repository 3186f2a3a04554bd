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
    for package in PACKAGES:  # and their subpackages (moe.attention)
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
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
    assert definitions(ast.FunctionDef, "resolve_layout") == ["parallel.resolve"]


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


def test_attention_runs_through_the_one_kernel_core():
    """One rule picks the kernel (``moe.attention.kernel.choose_kernel``), and SDPA is called only there and by the
    chunks of context parallelism's shards, which the kernel core chooses (``moe/sequence_shards.py``); every
    attention kind attends through ``attend``, and the memory model asks the kinds, which ask ``choose_kernel``."""
    assert definitions(ast.FunctionDef, "choose_kernel") == ["moe.attention.kernel"]
    callers = sorted(module for module, path in modules().items()
                     if "scaled_dot_product_attention(" in path.read_text(encoding="utf-8"))
    assert callers == ["moe.attention.kernel", "moe.sequence_shards"]
    # linear attention (Gated DeltaNet) has no softmax kernel: its recurrence is its own; the kinds' helpers
    # (compressors, indexers, RoPE variants, the delta rule's kernels) are no kinds
    from moe.attention import KINDS
    kinds = sorted({kind.__module__ for kind in KINDS.values()} - {"moe.attention.gated_delta"})
    assert kinds
    for module in kinds:
        source = modules()[module].read_text(encoding="utf-8")
        # they attend through ``attend`` and count their bytes by ``training_kernel``, both ``choose_kernel``'s
        assert "attend(" in source and "training_kernel(" in source, f"{module} bypasses the kernel core"


def test_the_model_and_block_name_no_family_and_no_attention_option():
    """The model and its blocks dispatch on the layer pattern alone: no attention option or family name in them
    (those live in the kinds' modules and the config's pattern)."""
    options = ("latent_attention", "attention_sinks", "sliding_window", "qk_norm", "kv_lora_rank", "qkv_bias",
               "attn_output_bias", "rotary_dim", "layer_types", "is_moe_layer", "deepseek", "mixtral", "qwen",
               "gpt_oss", "glm")
    for module in ("moe.transformer", "moe.block"):
        code = [node for node in ast.walk(ast.parse(modules()[module].read_text(encoding="utf-8")))
                if isinstance(node, ast.Name | ast.Attribute | ast.Constant)]
        named = {getattr(node, "id", None) or getattr(node, "attr", None) for node in code}
        named |= {node.value.lower() for node in code if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        assert not {word for word in named if word and any(option == word for option in options)}, module


def test_modules_and_functions_stay_readable():
    """No module of the packages over 500 lines, no function over 80 (docs/architecture.md: one concept per room)."""
    long = []
    for module, path in modules().items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 500:
            long.append(f"{module}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 80:
                long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, "\n".join(long)


def test_every_package_and_subpackage_is_installed():
    """pyproject.toml lists packages explicitly, and setuptools installs no subpackage it is not told of: a wheel
    without ``moe.attention`` would import nothing."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(path.parent.relative_to(ROOT).parts) for package in PACKAGES
             for path in (ROOT / package).rglob("__init__.py")}
    assert listed == found
