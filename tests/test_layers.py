"""The import direction of the layout (STYLE.md): imports point down, and entry points live in cli/.

cli → everything; benchmarks → all but cli; rl (the RL control plane) → actors (their configs), runtime,
protocols, engine, tasks; actors → engine, runtime, protocols, tasks, and the modules of actors/ that define
no actor class (an actor's own part, e.g. its request bookkeeping), never another actor's module; tasks →
engine (its tokenizer); runtime → protocols; engine → engine; protocols → protocols.
Every import of `slipstream.*` counts, lazy ones inside functions and relative ones too. Whether a module
defines an actor class is read from its source: a class deriving from the runtime's `Actor`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("protocols", "runtime", "engine", "tasks", "actors", "rl", "benchmarks", "cli", "deploy")
ALLOWED: dict[str, set[str]] = {
    "protocols": {"protocols"},
    "runtime": {"protocols", "runtime"},
    "engine": {"engine"},
    "tasks": {"tasks", "engine"},
    "actors": {"actors", "engine", "runtime", "protocols", "tasks"},  # `actors`: no actor's module
    "rl": {"rl", "protocols", "runtime", "engine", "tasks", "actors"},
    "benchmarks": {"protocols", "runtime", "engine", "tasks", "actors", "rl", "benchmarks"},
    "cli": set(LAYERS),
    "deploy": set(),
}


def _module_file(root: Path, module: str) -> Path | None:
    """The file under `root` that `slipstream.<...>` module names, if there is one."""
    path = root.joinpath(*module.split(".")[1:])
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def _imported(tree: ast.AST, root: Path, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import in `tree`, a module of `package`; relative ones made absolute."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            base = package.split(".")  # `from . import x` in slipstream/actors/a.py: slipstream.actors.x
            base = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            # `from slipstream import engine`, `from slipstream.actors import rollout_samples`: the alias is
            # the module imported.
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                whole = module == "slipstream" or _module_file(root, sub) is not None
                out.append((node.lineno, sub if whole else module))
    return sorted(set(out))


def _defines_actor(path: Path) -> bool:
    """Whether the module at `path` defines an actor class: one deriving from runtime/actor.py's `Actor`
    (by that name, an alias imported for it, or `actor.Actor`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = {"Actor"} | {
        alias.asname
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "slipstream.runtime.actor"
        for alias in node.names
        if alias.name == "Actor" and alias.asname
    }
    return any(
        (isinstance(base, ast.Name) and base.id in names)
        or (isinstance(base, ast.Attribute) and base.attr == "Actor")
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for base in node.bases
    )


def violations(root: Path) -> list[str]:
    """Every import edge under `root` that goes against ALLOWED, as 'file:line: a -> b'."""
    found = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            package = ".".join(["slipstream", *path.relative_to(root).parent.parts])
            for line, module in _imported(tree, root, package):
                parts = module.split(".")
                if parts[0] != "slipstream" or len(parts) < 2:
                    continue
                target = parts[1]
                where = f"{path.relative_to(root)}:{line}: {layer} -> {module}"
                if target not in ALLOWED[layer]:
                    found.append(where)
                elif layer == target == "actors" and len(parts) > 2:
                    imported = _module_file(root, module)
                    if imported is None:
                        found.append(f"{where} (no such module in actors/)")
                    elif imported != path and _defines_actor(imported):
                        found.append(f"{where} (an actor imports another actor)")
    return found


def test_the_tree_imports_downwards() -> None:
    assert violations(ROOT) == []


_AN_ACTOR = "from slipstream.runtime.actor import Actor\n\n\nclass DrafterActor(Actor):\n    pass\n"


def test_a_planted_upward_edge_is_caught(tmp_path: Path) -> None:
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "planted.py").write_text("def f():\n    from slipstream.engine import model\n")
    (tmp_path / "actors").mkdir()
    (tmp_path / "actors" / "drafter.py").write_text(_AN_ACTOR)
    (tmp_path / "actors" / "a.py").write_text("from slipstream.actors.drafter import weights_checksum\n")
    (tmp_path / "actors" / "up.py").write_text("from slipstream.rl.coordinator import Coordinator\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "b.py").write_text("from slipstream import cli\n")
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "r.py").write_text("from slipstream.cli import train\n")
    for layer in ("runtime", "engine", "tasks", "protocols"):  # none of them may import the RL plane
        (tmp_path / layer).mkdir(exist_ok=True)
        (tmp_path / layer / "to_rl.py").write_text("from slipstream import rl\n")
    assert sorted(violations(tmp_path)) == [
        "actors/a.py:1: actors -> slipstream.actors.drafter (an actor imports another actor)",
        "actors/up.py:1: actors -> slipstream.rl.coordinator",
        "benchmarks/b.py:1: benchmarks -> slipstream.cli",
        "engine/to_rl.py:1: engine -> slipstream.rl",
        "protocols/to_rl.py:1: protocols -> slipstream.rl",
        "rl/r.py:1: rl -> slipstream.cli",
        "runtime/planted.py:2: runtime -> slipstream.engine",
        "runtime/to_rl.py:1: runtime -> slipstream.rl",
        "tasks/to_rl.py:1: tasks -> slipstream.rl",
    ]


def test_an_actor_imports_its_own_part_but_no_other_actor(tmp_path: Path) -> None:
    actors = tmp_path / "actors"
    actors.mkdir()
    (actors / "drafter.py").write_text(_AN_ACTOR)
    (actors / "aliased.py").write_text(
        "from slipstream.runtime import actor\n\n\nclass VerifierActor(actor.Actor):\n    pass\n"
    )
    (actors / "rollout_samples.py").write_text("from slipstream.engine.sampling import SamplingParams\n")
    (actors / "rollout.py").write_text(
        _AN_ACTOR.replace("Drafter", "Rollout")
        + "from slipstream.actors.rollout_samples import Sample\n"  # its own part: allowed
        + "from slipstream.actors import rollout_samples\n"
        + "from .rollout_samples import Sample\n"
        + "from . import drafter\n"  # another actor, relatively
        + "from slipstream.actors import aliased\n"  # another actor, as a package member
    )
    assert violations(tmp_path) == [
        "actors/rollout.py:9: actors -> slipstream.actors.drafter (an actor imports another actor)",
        "actors/rollout.py:10: actors -> slipstream.actors.aliased (an actor imports another actor)",
    ]
