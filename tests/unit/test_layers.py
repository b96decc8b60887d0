"""The import structure of the package (docs/architecture.md): stages on floors, imports pointing
down only, no cycle, integrations on the public API only, no demo or benchmark code installed.

Every import statement counts, also one inside a function (a lazy import is still a dependency)
and one under ``if TYPE_CHECKING:`` (an annotation names an object that flows in at run time).
"""

from __future__ import annotations

import ast
import importlib
import os

import pytest

import datastates

PACKAGE = os.path.dirname(datastates.__file__)

#: Floors, lowest first, in the order of the stages: records, commit, save and restore, one tier,
#: the tiers, the public entry points, tools, integrations. A module imports modules of its own
#: floor or lower only (within a floor, with no circle: test_no_import_cycles).
FLOORS = [
    ["datastates._version", "datastates.errors", "datastates.memory.options", "datastates.config"],
    ["datastates.storage", "datastates.format", "datastates.providers", "datastates.data"],
    ["datastates.commit"],
    ["datastates.save", "datastates.restore"],
    ["datastates.directory"],
    ["datastates.memory"],
    ["datastates.checkpointer", "datastates.dcp", "datastates.preemption"],
    ["datastates.tools", "datastates.testing", "datastates", "datastates.__main__"],
    ["datastates.integrations"],
]
#: What code outside the core (the integrations) may import: these modules and the names in
#: their ``__all__``.
PUBLIC = [
    "datastates",
    "datastates.format",
    "datastates.storage",
    "datastates.providers",
    "datastates.commit",
    "datastates.dcp",
    "datastates.testing",
]
#: ``from datastates import CheckpointEngine`` is how DeepSpeed finds its engine: the package
#: resolves that one name lazily (PEP 562) from the DeepSpeed adapter.
ALLOWED_UP = {("datastates", "datastates.integrations.deepspeed")}


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), os.path.dirname(PACKAGE))[:-3]
                parts = rel.split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = os.path.join(folder, name)
    return out


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES.get(module, "").endswith("__init__.py")


def imports(module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every datastates import of ``module``."""
    tree = ast.parse(open(MODULES[module]).read())
    package = module if _is_package(module) else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [
                (a.name, [], node.lineno)
                for a in node.names
                if a.name.split(".")[0] == "datastates"
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "datastates":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in MODULES:
                    out.append((sub, [], node.lineno))
                else:
                    out.append((source, [alias.name], node.lineno))
    return out


def floor_of(module: str) -> tuple[int, str]:
    best = None
    for level, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + ".") and prefix != "datastates":
                if best is None or len(prefix) > len(best[1]):
                    best = (level, prefix)
    assert best is not None, f"{module} is on no floor: add it to FLOORS"
    return best


def test_every_module_is_on_a_floor():
    for module in MODULES:
        floor_of(module)


def test_imports_point_down():
    wrong = []
    for module in MODULES:
        level, _ = floor_of(module)
        for target, _, line in imports(module):
            if (module, target) in ALLOWED_UP or target not in MODULES:
                continue
            t_level, _ = floor_of(target)
            if t_level > level:
                wrong.append(
                    f"{MODULES[module]}:{line}: {module} (floor {level}) imports "
                    f"{target} (floor {t_level})"
                )
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {
        m: {t for t, _, _ in imports(m) if t in MODULES and t != m and (m, t) not in ALLOWED_UP}
        for m in MODULES
    }
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_integrations_import_only_the_public_api():
    wrong = []
    for module in MODULES:
        if not module.startswith("datastates.integrations"):
            continue
        for target, names, line in imports(module):
            if target.startswith("datastates.integrations") or (module, target) in ALLOWED_UP:
                continue
            public = (
                importlib.import_module(target).__dict__.get("__all__", [])
                if target in PUBLIC
                else []
            )
            if target not in PUBLIC or any(n not in public for n in names):
                wrong.append(f"{MODULES[module]}:{line}: {target} {names}")
    assert not wrong, "\n".join(wrong)


def test_integrations_use_only_public_names_of_datastates():
    """``datastates.X`` (and ``_core().X``, the integrations' lazy handle on the package) names
    only what ``datastates.__all__`` exports: a name that moved inside the core fails here, not
    on a user's DeepSpeed run."""
    wrong = []
    for module, path in MODULES.items():
        if not module.startswith("datastates.integrations"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if not isinstance(node, ast.Attribute):
                continue
            base = node.value
            rooted = (isinstance(base, ast.Name) and base.id == "datastates") or (
                isinstance(base, ast.Call)
                and isinstance(base.func, ast.Name)
                and base.func.id == "_core"
            )
            if rooted and node.attr not in datastates.__all__:
                wrong.append(f"{path}:{node.lineno}: datastates.{node.attr}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("module", PUBLIC)
def test_every_public_name_exists(module):
    mod = importlib.import_module(module)
    assert mod.__all__, module
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.__all__ names {name!r}, which it does not define"


def test_no_demo_or_benchmark_code_is_installed():
    assert not [m for m in MODULES if any(w in m for w in ("demo", "bench"))]


def _private_writes(path: str) -> list[str]:
    """``x._name = ...`` (or ``+=``) where ``x`` is not ``self``/``cls``: an object configured
    from outside through its private attributes."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for target in targets:
            for sub in ast.walk(target):
                if (
                    isinstance(sub, ast.Attribute)
                    and sub.attr.startswith("_")
                    and not sub.attr.startswith("__")
                    and not (isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"))
                ):
                    found.append(f"{path}:{node.lineno}: {ast.unparse(sub)}")
    return found


def test_no_object_is_configured_through_its_private_attributes():
    wrong = [w for path in MODULES.values() for w in _private_writes(path)]
    assert not wrong, "\n".join(wrong)


#: What a Checkpointer's tier once read from slots the memory tier wrote into it; a tier's
#: differences are its TierPolicy now (directory.py), given at construction.
HOOK_SLOTS = [
    "_optimistic",
    "_prechecked",
    "_group",
    "_agree",
    "_order",
    "_eligible",
    "_on_commit",
    "_exclusive",
    "_check_storage_name",
    "_delete_guard",
    "_released",
    "_retention",
    "_tiers",
]


def test_a_checkpointer_has_no_hook_slots():
    for module in ("datastates.checkpointer", "datastates.directory"):
        tree = ast.parse(open(MODULES[module]).read())
        slots = {
            f"{MODULES[module]}:{n.lineno}: self.{n.attr}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == "self"
            and n.attr in HOOK_SLOTS
        }
        assert not slots, "\n".join(sorted(slots))
