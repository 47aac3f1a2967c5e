"""The floors of the codebase, checked on the import graph: stages meet only through `proto/` and the
lower floor (`runtime.base`, `runtime.common`, `kernels`); `proto/` imports nothing of ours and no torch;
the lower floor never reaches up into the stages, the assembly or the tools; nothing shipped (the tools
included) imports the reproduction scripts of `benchmarks/`, which stay out of the wheel. Imports inside
functions count too (they are the usual way a leak hides)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("runtime", "stages", "kernels", "proto", "tools", "benchmarks", "tests")
FLOOR = ("runtime.base", "runtime.common", "kernels")


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (annotations only: never run)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _imports(module: str, source: str, runtime_only: bool = False) -> list[str]:
    """Every absolute module name `source` imports (relative imports resolved against `module`);
    `runtime_only` leaves out imports made for type checking alone."""
    found = []
    tree = ast.parse(source)
    skip = _type_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                found.append(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.append(node.module)
    return found


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(module: str, source: str) -> list[str]:
    """The floor rules `module` (dotted name) breaks with the imports in `source`."""
    bad = []
    for name in _imports(module, source):
        top = name.split(".")[0]
        if _under(module, "proto"):
            if (top in OURS and top != "proto") or top == "torch":
                bad.append(f"{module} imports {name}: proto/ imports nothing of ours and no torch")
        elif any(_under(module, f) for f in FLOOR):
            if top in ("stages", "tools", "benchmarks", "tests") or (
                top == "runtime" and not any(_under(name, f) for f in FLOOR)
            ):
                bad.append(f"{module} imports {name}: the lower floor never imports above itself")
        elif _under(module, "stages"):
            stage = module.split(".")[1]
            if top == "stages" and len(name.split(".")) > 1 and name.split(".")[1] != stage:
                bad.append(f"{module} imports {name}: stages meet only through proto/ and the floor")
            elif top in ("tools", "benchmarks", "tests") or (
                top == "runtime" and not any(_under(name, f) for f in FLOOR)
            ):
                bad.append(f"{module} imports {name}: a stage imports only proto/ and the lower floor")
        elif top == "benchmarks" and module.split(".")[0] != "benchmarks":
            bad.append(f"{module} imports {name}: shipped code never imports benchmarks/ (not in the wheel)")
        elif top in ("tools", "tests") and top != module.split(".")[0] and not _under(module, "tools"):
            bad.append(f"{module} imports {name}: shipped code never imports tools/ or tests/")
    return bad


RUNTIME = ("proto", "runtime", "stages", "kernels")


def _tree(packages: tuple[str, ...] = (*RUNTIME, "tools")) -> list[tuple[str, Path]]:
    mods = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            mods.append((".".join(parts), path))
    return mods


def test_the_tree_keeps_its_floors():
    bad = [v for module, path in _tree() for v in violations(module, path.read_text())]
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize(
    "module, source",
    [
        ("stages.loader.actor", "from stages.worker.runner import ModelRunner"),
        ("stages.scheduler.planner", "def f():\n    import stages.loader.actor\n"),
        ("stages.worker.runner", "from runtime.launcher import Launcher"),
        ("stages.worker.runner", "from tools.make_adapters import make_adapters"),
        ("proto.plan", "import torch"),
        ("proto.plan", "from runtime.common.lora_layout import NUM_SLICES"),
        ("runtime.common.host_pool", "from stages.scheduler.host_table import aligned"),
        ("runtime.base.actor", "from runtime.serve_args import ServeArgs"),
        ("kernels.lora_shrink", "from stages.worker.lora.pool import LoraPool"),
        ("runtime.offline", "from tools.make_tiny_model import make_model"),
        ("stages.worker.actor", "from ..loader import actor"),
        ("tools.bench_serving", "from benchmarks import bench_peft"),
        ("runtime.cli", "import benchmarks.bench_tp"),
    ],
)
def test_each_rule_catches_its_leak(module, source):
    assert violations(module, source), f"{module}: {source!r} should break a floor rule"


@pytest.mark.parametrize(
    "module, source",
    [
        ("stages.scheduler.actor", "from stages.scheduler.host_table import HostTable"),
        ("stages.worker.runner", "from runtime.common.model_config import ModelConfig\nimport kernels"),
        ("stages.tokenizer.actor", "from runtime.base.actor import Actor\nfrom proto.client import Hello"),
        ("runtime.launcher", "from stages.worker.config import WorkerConfig"),
        ("proto.plan", "import msgspec\nfrom proto.base import Record"),
    ],
)
def test_allowed_imports_pass(module, source):
    assert violations(module, source) == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle among `graph`'s modules (one representative path per strongly connected set)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            comp = []
            while True:
                top = stack.pop()
                comp.append(top)
                if top == node:
                    break
            if len(comp) > 1 or node in graph.get(node, ()):
                found.append(sorted(comp))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _module_graph() -> dict[str, set[str]]:
    mods = dict(_tree(RUNTIME))
    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        targets = set()
        for name in _imports(module, path.read_text(), runtime_only=True):
            while name and name not in mods:  # `from a.b import c` names module a.b (or a.b.c)
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                targets.add(name)
        graph[module] = targets
    return graph


def test_no_import_cycles():
    assert cycles(_module_graph()) == []


def test_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


MAX_MODULE_LINES = 400  # small files with one clear job (docs/architecture.md)


def test_no_module_of_the_runtime_is_over_the_line_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for top in ("stages", "runtime", "kernels", "proto")
        for p in (ROOT / top).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"


def test_the_reproduction_scripts_stay_out_of_the_wheel():
    import fnmatch
    import tomllib

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = [
        p for p in find["include"] if fnmatch.fnmatch("benchmarks", p) or fnmatch.fnmatch("benchmarks.x", p)
    ]
    assert shipped == [], f"pyproject.toml ships benchmarks/ through {shipped}"
    assert "tools*" in find["include"]  # what users run does ship
