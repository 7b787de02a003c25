"""The package's layers, read off its source: imports point down the data flow, never up, no circles.

Every import counts, those inside functions too. A layer may import the layers below it
(and itself); two packages on one level know nothing of each other.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from hpc_hsdp.job.task_call import RUN_TASK, RUN_TORCHRUN

PACKAGE = Path(__file__).resolve().parents[2] / "hpc_hsdp"

# top first; "" is the package face (hpc_hsdp/__init__.py, __main__.py)
LEVELS = (
    ("",),
    ("cli",),
    ("task", "submit_host"),
    ("batch_shell",),
    ("scheduler",),
    ("job",),
    ("models", "report"),
    ("data",),
    ("rundir",),
    ("plan",),
    ("errors", "files", "_version"),
)
LEVEL_OF = {name: depth for depth, names in enumerate(LEVELS) for name in names}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "hpc_hsdp":
                found.update(f"hpc_hsdp.{alias.name}" for alias in node.names)
            elif node.module.startswith("hpc_hsdp."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("hpc_hsdp"))
    return found


def _room(module: str) -> str:
    """``hpc_hsdp.job.spec`` -> ``job``; the face (``hpc_hsdp``, ``hpc_hsdp.__main__``) -> ``""``."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return ""
    return parts[1] if parts[1] in LEVEL_OF else ""


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            # "from hpc_hsdp.rundir.lifecycle import attempts" names a module; "from hpc_hsdp.job.spec import X" a name in one
            while imported not in modules and "." in imported:
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def test_every_room_of_the_package_has_a_level():
    rooms = {_room(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    # a folder a move left with only __pycache__ in it (an old checkout's runtime/) is no room
    top = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or any(p.rglob("*.py"))}
    unknown = {r for r in top - {"__init__", "__main__", "__pycache__", "templates"} if r not in LEVEL_OF}
    assert not unknown, f"add {sorted(unknown)} to LEVELS"
    assert rooms <= set(LEVEL_OF)


def test_the_package_root_is_its_public_face_only():
    root_modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root_modules) <= 5, root_modules


def test_imports_point_down_the_layers():
    upward = []
    for module, targets in _graph().items():
        source = _room(module)
        for target in targets:
            room = _room(target)
            if room != source and LEVEL_OF[room] <= LEVEL_OF[source]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run up or sideways:\n  " + "\n  ".join(sorted(upward))


def test_nothing_inside_the_package_imports_its_face():
    graph = _graph()
    importers = sorted(m for m, targets in graph.items() if "hpc_hsdp" in targets and _room(m) != "")
    assert not importers


def test_no_import_circles():
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = 2
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            pytest.fail("import circle: " + " -> ".join(cycle))


@pytest.mark.parametrize("call", [RUN_TASK, RUN_TORCHRUN], ids=lambda c: c.target)
def test_what_a_task_runs_is_named_by_a_path_that_exists(call):
    module, _, name = call.target.partition(":")
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, call.target


SAME_ROLE = {
    "__init__.py": "a package's face",
    "__main__.py": "a package run as a program (python -m: the package face's CLI, the emulator's processes)",
    "base.py": "the interface of a family behind it (scheduler/backends: the schedulers; models: the adapters)",
    "files.py": "file helpers: the package's atomic writes and hostile-file reader, and the run directory's on them",
}
"""Module names that repeat across folders because each is the same kind of thing in its folder."""


def test_a_module_name_repeats_only_where_it_is_the_same_thing():
    """Where names repeated (replicas.py three times, staging.py three times), a reader could not
    tell the modules apart by name: each one has a name of its own (rundir's records end in
    ``_record``) but for the few of :data:`SAME_ROLE`."""
    by_name: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        by_name.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    repeated = {name: paths for name, paths in by_name.items() if len(paths) > 1 and name not in SAME_ROLE}
    assert repeated == {}, repeated


def test_the_architecture_page_names_every_module():
    """docs/architecture.md is the one place that names the package's files: a module it does not
    name is a room a newcomer cannot find (the commands under cli/ are named by the commands)."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", page))
    unnamed = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.stem not in ("__init__", "__main__") and "cli" not in path.relative_to(PACKAGE).parts
        if path.stem not in words
    ]
    assert unnamed == [], f"modules docs/architecture.md does not name: {unnamed}"


def _local_shard_helpers() -> list[str]:
    """Functions of the runtime that hand back a DTensor's local tensor (``t._local_tensor`` or
    ``t.to_local()``) and a plain tensor as it is: ``x if isinstance(t, DTensor) else t``."""
    found = []
    for path in sorted((PACKAGE / "task").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or len(node.body) < 1:
                continue
            body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.IfExp):
                continue
            test, then = body[0].value.test, ast.unparse(body[0].value.body)
            is_dtensor = "isinstance" in ast.unparse(test) and "DTensor" in ast.unparse(test)
            if is_dtensor and then.endswith(("._local_tensor", ".to_local()")):
                found.append(f"{path.stem}.{node.name}")
    return found


def test_one_helper_gives_a_dtensors_local_shard():
    # the optimizer, the gradient norm and clipping, and the replica group's state each had their own
    assert _local_shard_helpers() == ["optimizer.local_shard"]


def _test_imports(path: Path) -> list[str]:
    """The test modules (``tests.<tier>.test_*``) that ``path`` imports, function-level imports too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [n for n in names if re.fullmatch(r"tests\.\w+\.test_\w+", n)]
    return found


def test_no_test_module_imports_another():
    """A test module is read as documentation of what it tests: what several share lives in a
    ``tests/*_helpers.py`` module (not a test module: pytest collects nothing from it), never in a
    test module that another imports (20 such imports, some across tiers, made a tier's run depend
    on another tier's file)."""
    tests = PACKAGE.parent / "tests"
    importing = {
        str(path.relative_to(tests)): found for path in sorted(tests.rglob("*.py")) if (found := _test_imports(path))
    }
    assert importing == {}, importing
