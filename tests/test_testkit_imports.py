"""bench/, scripts/, examples/ and testkit/ take shared helpers from testkit/, never from tests/ (whose
modules are pytest's to import, and move with the source's layout): every import in their files, read
from the syntax tree, whether spelled `tests.x` or as a bare test module put on sys.path."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARERS = ("bench", "scripts", "examples", "testkit")


def imported(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_nothing_outside_tests_imports_from_tests():
    test_modules = {p.stem for p in (REPO / "tests").rglob("*.py")}
    seen, offenders = set(), []
    for folder in SHARERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            for name in imported(path):
                top = name.split(".")[0]
                seen.add(top)
                if top == "tests" or top in test_modules:
                    offenders.append(f"{path.relative_to(REPO)}: {name}")
    assert offenders == []
    assert "testkit" in seen and "server" in seen  # the scan reads the imports it guards
