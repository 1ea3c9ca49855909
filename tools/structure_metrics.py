"""The structure's numbers, printed from the code (the redesign's yardsticks):

    python tools/structure_metrics.py [--list]

functions over 100 (and 60) lines, private reaches into the Engine / scheduler / handlers / drafts from
other modules (tests/test_structure.py), Engine + handlers lines, `Call` uses, imports inside functions,
and comments that cite an issue or a session. `--list` names each place. Duplicate pairs come from the
tool library's `duplicates` command where it is installed (it is not part of the project)."""
from __future__ import annotations

import argparse
import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("engine", "app", "strata_fetch")
sys.path.insert(0, str(ROOT / "tests"))
from test_structure import private_reaches  # noqa: E402


def _files(folders=CODE):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def long_functions(limit: int) -> list[str]:
    out = []
    for path in _files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


def inner_imports() -> list[str]:
    out = []
    for path in _files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        out.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return sorted(set(out))


def call_uses() -> list[str]:
    out = []
    for path in _files(CODE + ("tests", "bench")):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\bCall\(", line):
                out.append(f"{path.relative_to(ROOT)}:{i}")
    return out


CITES = re.compile(r"\b(issue|session)s? ?#?\d+", re.IGNORECASE)


def history_comments() -> list[str]:
    out = []
    for path in _files():
        src = path.read_text(encoding="utf-8")
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING) and CITES.search(tok.string):
                if tok.type == tokenize.STRING and not tok.string.lstrip("rbuRBU").startswith(('"""', "'''")):
                    continue        # a plain string is text for the user, not a comment
                out.append(f"{path.relative_to(ROOT)}:{tok.start[0]}")
    return out


def duplicate_pairs() -> str:
    """Pairs within each of engine/, app/, strata_fetch/ (the tool reads one folder at a time)."""
    tool = shutil.which("duplicates")
    if tool is None:
        return "n/a (the `duplicates` tool is not installed here)"
    counts = []
    for folder in CODE:
        r = subprocess.run([tool, "--repo", folder, "--most", "200", "--seconds", "120"], cwd=ROOT,
                           capture_output=True, text=True)
        m = re.match(r"(\d+) pairs? of places", r.stdout)
        counts.append(f"{folder} {m.group(1) if m else 0}")
    return ", ".join(counts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="name each place")
    args = ap.parse_args()
    lines = sum(len((ROOT / f).read_text().splitlines()) for f in ("engine/engine.py", "engine/handlers.py"))
    rows = [("functions > 100 lines", long_functions(100)), ("functions > 60 lines", long_functions(60)),
            ("private reaches into Engine/scheduler/handlers/drafts", private_reaches()),
            ("Call uses", call_uses()), ("imports inside functions", inner_imports()),
            ("comments citing an issue or a session", history_comments())]
    for name, found in rows:
        print(f"{name}: {len(found)}")
        if args.list:
            for f in found:
                print(f"    {f}")
    print(f"Engine + handlers lines: {lines}")
    print(f"duplicate pairs: {duplicate_pairs()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
