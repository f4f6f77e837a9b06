"""The docs that are generated or linked stay true: docs/flags.md is what the CLI's table renders, and no
relative link in README.md or docs/ (nor a docs/results path in the code) points at nothing."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_flags_doc_is_current():
    gen = _script("gen_flags_doc")
    rendered = gen.render()
    assert (REPO / "docs" / "flags.md").read_text() == rendered, \
        "docs/flags.md is stale: run python scripts/gen_flags_doc.py"
    from server.cli import SERVE_OPTIONS
    for opt in SERVE_OPTIONS:  # every flag and its variable is on the page
        assert f"`{opt.flag}" in rendered and f"`{opt.env}`" in rendered, opt.flag


def test_no_dead_doc_links():
    dead = _script("check_doc_links").dead_links()
    assert dead == [], "\n".join(dead)


def test_link_checker_finds_a_dead_link(tmp_path, monkeypatch):
    """The checker must fail on a link to nothing (so the test above can fail)."""
    checker = _script("check_doc_links")
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "README.md").write_text("# r\n")
    gone = "docs/" + "results/gone/x.json"  # split, so the checker does not find it in this file
    (tmp_path / "README.md").write_text(f"[a](docs/missing.md) and `{gone}`\n")
    for folder in ("bench", "tests", "server", "allocator"):
        (tmp_path / folder).mkdir()
    monkeypatch.setattr(checker, "REPO", tmp_path)
    monkeypatch.setattr(checker, "RESULTS", tmp_path / "docs" / "results")
    dead = checker.dead_links()
    assert any("docs/missing.md" in d for d in dead) and any("gone/x.json" in d for d in dead), dead


def test_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 400
