"""The engine's structure, checked from the code: no module reaches into another module's private members
of the Engine, its scheduler, its request handlers or its drafts (engine/scheduler.py is the one owner of
what runs next; engine/handlers.py's turn API is public). The names below are how the code refers to those
objects; a private member (`_x`) read through one of them outside the module that defines it fails."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# how code names each object -> the module that owns its private members
OWNERS = {"eng": "engine/engine.py", "engine": "engine/engine.py", "handlers": "engine/handlers.py",
          "scheduler": "engine/scheduler.py", "drafts": "engine/drafts.py"}


def _base_name(node: ast.AST) -> str | None:
    """`eng` for eng._x, `engine` for self.engine._x, `handlers` for eng.handlers._x."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def private_reaches(root: Path = ROOT) -> list[str]:
    found = []
    for folder in ("engine", "app", "strata_fetch", "bench", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                    continue
                owner = OWNERS.get(_base_name(node.value) or "")
                if owner is not None and owner != rel:
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_the_engines_private_members():
    assert private_reaches() == []


def test_the_check_finds_a_reach(tmp_path):
    """The check itself: a module reading `engine._queue` is found."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "other.py").write_text("def f(engine):\n    return engine._queue.get()\n")
    assert private_reaches(tmp_path) == ["engine/other.py:2: engine._queue"]
