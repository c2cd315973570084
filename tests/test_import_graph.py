"""The package's own import graph: no cycles, lower layers never reach up, and an import inside a function says why.

The graph is read from the source (the AST of every module under hpc_rlhf/), not from a running interpreter, so
it holds every import, also those inside functions that run only on some paths. An edge A -> B means module A
imports module B (`from hpc_rlhf.dist import watchdog` is an edge to hpc_rlhf.dist.watchdog). Commands that
the CLI loads by name (launch.modes.TRAINING_MODES and COMMANDS, launch/__init__'s lazy names) are not edges: the CLI
knows their names, not their code.

The layering, lowest first; an area may import itself and the areas listed for it, nothing else:

    utils, config, algorithms    no other area of the package (pure helpers, typed configs, pure math)
    models                       config, utils
    dist                         config, utils   (never launch/, trainers/, engines/, models/)
    data                         config, models, utils
    engines                      config, models, dist, algorithms, utils
    rewards                      data, config, utils
    envs                         data, config, utils   (environments and the episode driver: engine-agnostic, they
                                 get generation as a callable; data gives the chat templates and the tiny task)
    runtime                      config, utils, algorithms, models, dist, data, engines (the run plumbing every
                                 recipe shares: start of a run, checkpoints, frozen reference, the one-model loop)
    trainers                     everything above but envs (the one-model recipes only)
    rl                           everything above but trainers/ (the RL recipe; trainers never import it, and it
                                 imports no one-model recipe: what it shares with them is in runtime/)
    scale                        everything above, rl/ included (a large job without a cluster: the simulated
                                 world, the communicator count, the step-time model, `plan` and `simulate`)
    launch                       everything above (starting jobs and modes: the library under the command line)
    cli, __main__, chat, demo,   the entry points: anything
    plot, openrlhf, serve_rm

Within dist/, the modules a process joins the world with sit below those that run on the world:
hostlist, placement, launch_env, liveness <- store_host, watchdog <- bootstrap (tested by the acyclicity and
the explicit edges below).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hpc_rlhf"

ENTRY_POINTS = {"cli", "__main__", "chat", "demo", "plot", "openrlhf", "serve_rm"}
LOWER = {
    "utils": set(),
    "config": set(),
    "algorithms": set(),
    "models": {"config", "utils"},
    "dist": {"config", "utils"},
    "data": {"config", "models", "utils"},
    "engines": {"config", "models", "dist", "algorithms", "utils"},
    "rewards": {"data", "config", "utils"},
    "envs": {"data", "config", "utils"},
    "runtime": {"config", "utils", "algorithms", "models", "dist", "data", "engines"},
    "trainers": {"config", "utils", "algorithms", "models", "dist", "data", "engines", "rewards", "runtime"},
    "rl": {"config", "utils", "algorithms", "models", "dist", "data", "engines", "rewards", "envs", "runtime"},
    "scale": {"config", "utils", "algorithms", "models", "dist", "data", "engines", "rewards", "envs", "runtime",
              "trainers", "rl"},
    "launch": {"config", "utils", "algorithms", "models", "dist", "data", "engines", "rewards", "envs", "runtime",
               "trainers", "rl", "scale"},
}
# The package root (hpc_rlhf/__init__.py) pins the CPU kernels and quiets torch's C++ warnings before torch loads,
# and nothing more.
ROOT_MAY_IMPORT = {"hpc_rlhf.utils.cpu_kernels", "hpc_rlhf.utils.console"}


def module_files() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = module_files()


def _target(name: str) -> str | None:
    """The package module that importing `name` loads (`name` may end in a class or function name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's package upwards
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    # `from X import a`: X.a when a is a module, else X itself
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]


class Import:
    __slots__ = ("source", "target", "line", "in_function")

    def __init__(self, source: str, target: str, line: int, in_function: bool):
        self.source, self.target, self.line, self.in_function = source, target, line, in_function

    def __repr__(self) -> str:
        where = "inside a function" if self.in_function else "at module level"
        return f"{self.source} -> {self.target} ({MODULES[self.source].name}:{self.line}, {where})"


def package_imports() -> list[Import]:
    found = []
    for module, path in MODULES.items():
        is_package = path.name == "__init__.py"
        seen: set[tuple[str, int]] = set()

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for name in _imported(child, module, is_package):
                        target = _target(name) if name.split(".")[0] == "hpc_rlhf" else None
                        if target and target != module and (target, child.lineno) not in seen:
                            seen.add((target, child.lineno))
                            found.append(Import(module, target, child.lineno, inside))
                visit(child, inside)

        visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


IMPORTS = package_imports()


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "hpc_rlhf"


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_graph_is_read_from_every_module():
    assert len(MODULES) > 50 and "hpc_rlhf.dist.watchdog" in MODULES
    edges = {(i.source, i.target) for i in IMPORTS}
    assert ("hpc_rlhf.rl.step", "hpc_rlhf.dist.groups") in edges  # `from hpc_rlhf.dist import groups`
    assert ("hpc_rlhf.rl.step", "hpc_rlhf.config") in edges      # `from hpc_rlhf.config import ...`


def test_find_cycle_finds_one_and_only_one_that_exists():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"b"}}) == ["b", "b"]


def test_the_package_import_graph_has_no_cycle():
    edges: dict[str, set[str]] = {}
    for found in IMPORTS:
        edges.setdefault(found.source, set()).add(found.target)
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_lower_layers_never_import_higher_ones():
    wrong = []
    for found in IMPORTS:
        source, target = area(found.source), area(found.target)
        if source == target or source in ENTRY_POINTS:
            continue
        if source == "hpc_rlhf":
            allowed = found.target in ROOT_MAY_IMPORT
        else:
            allowed = target in LOWER.get(source, set())
        if not allowed:
            wrong.append(found)
    assert not wrong, "imports that reach up (see this test's docstring):\n" + "\n".join(map(repr, wrong))


@pytest.mark.parametrize("lower, higher", [
    ("hpc_rlhf.dist.liveness", "hpc_rlhf.dist.watchdog"), ("hpc_rlhf.dist.liveness", "hpc_rlhf.dist.store_host"),
    ("hpc_rlhf.dist.store_host", "hpc_rlhf.dist.watchdog"), ("hpc_rlhf.dist.watchdog", "hpc_rlhf.dist.store_host"),
    ("hpc_rlhf.dist.watchdog", "hpc_rlhf.dist.bootstrap"), ("hpc_rlhf.dist.watchdog", "hpc_rlhf.dist.groups"),
    ("hpc_rlhf.dist.store_host", "hpc_rlhf.dist.bootstrap"), ("hpc_rlhf.dist.launch_env", "hpc_rlhf.dist.bootstrap"),
])
def test_within_dist_the_protocol_and_detection_import_nothing_above_them(lower, higher):
    assert not [i for i in IMPORTS if (i.source, i.target) == (lower, higher)]


def _comment_nearby(lines: list[str], index: int) -> bool:
    """A comment on the import's line, or in the block of imports (and blank lines) it belongs to, above it."""
    if "#" in lines[index]:
        return True
    index -= 1
    while index >= 0:
        stripped = lines[index].strip()
        if stripped.startswith("#"):
            return True
        if stripped and not stripped.startswith(("import ", "from ")):
            return False
        index -= 1
    return False


def test_imports_inside_functions_say_why():
    # An in-function import of the package's own code hides the graph; it is kept only for optional or heavy
    # dependencies, or to spare a mode an import it does not need, and then a comment says which.
    silent = []
    for found in IMPORTS:
        if found.in_function:
            lines = MODULES[found.source].read_text().splitlines()
            if not _comment_nearby(lines, found.line - 1):
                silent.append(found)
    assert not silent, "in-function imports without a comment saying why:\n" + "\n".join(map(repr, silent))
