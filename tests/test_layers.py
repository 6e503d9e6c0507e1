"""The import direction of the layout (STYLE.md): imports point down, and entry points live in cli/.

cli → everything; benchmarks → all but cli; rl (the RL control plane) → actors (their configs), runtime,
protocols, engine, tasks; actors → engine, runtime, protocols, tasks (never another actor); tasks → engine
(its tokenizer); runtime → protocols; engine → engine; protocols → protocols.
Every import of `slipstream.*` counts, lazy ones inside functions too.
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
    "actors": {"actors", "engine", "runtime", "protocols", "tasks"},  # `actors` itself: see below
    "rl": {"rl", "protocols", "runtime", "engine", "tasks", "actors"},
    "benchmarks": {"protocols", "runtime", "engine", "tasks", "actors", "rl", "benchmarks"},
    "cli": set(LAYERS),
    "deploy": set(),
}


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from slipstream import engine` names the layer in the alias, not the module.
            if node.module == "slipstream":
                out += [(node.lineno, f"slipstream.{alias.name}") for alias in node.names]
            else:
                out.append((node.lineno, node.module))
    return out


def violations(root: Path) -> list[str]:
    """Every import edge under `root` that goes against ALLOWED, as 'file:line: a -> b'."""
    found = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, module in _imported(tree):
                parts = module.split(".")
                if parts[0] != "slipstream" or len(parts) < 2:
                    continue
                target = parts[1]
                where = f"{path.relative_to(root)}:{line}: {layer} -> {module}"
                if target not in ALLOWED[layer]:
                    found.append(where)
                elif layer == target == "actors" and len(parts) > 2:
                    found.append(f"{where} (an actor imports another actor)")
    return found


def test_the_tree_imports_downwards() -> None:
    assert violations(ROOT) == []


def test_a_planted_upward_edge_is_caught(tmp_path: Path) -> None:
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "planted.py").write_text("def f():\n    from slipstream.engine import model\n")
    (tmp_path / "actors").mkdir()
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
