"""Find dead relative links in the docs and dead paths into docs/results/.

    python scripts/check_doc_links.py     # prints each dead link, exits 1 if there is one

Checked: every relative Markdown link (`[text](path)`, images too) in README.md, docs/*.md and
docs/results/README.md must name a file or folder that exists (anchors are not checked); every
`docs/results/...` path written in README.md, docs/*.md, bench/, tests/, server/ and allocator/ must
exist, except in docs/measurements.md, whose run log may name a run folder that docs/results/README.md
lists as kept in git history only. tests/test_docs.py runs this.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
RESULTS_PATH = re.compile(r"docs/results/[A-Za-z0-9._/-]*")
HISTORY_HEADING = "## In git history only"


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), RESULTS / "README.md"]


def source_files() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for folder in ("bench", "tests", "server", "allocator"):
        files += sorted(p for p in (REPO / folder).rglob("*.py"))
    return files


def history_runs() -> set[str]:
    """Run folders that docs/results/README.md lists under its git-history heading (`name/` in backticks)."""
    text = (RESULTS / "README.md").read_text() if (RESULTS / "README.md").exists() else ""
    _, _, tail = text.partition(HISTORY_HEADING)
    return set(re.findall(r"`([A-Za-z0-9._-]+)/`", tail))


def dead_links() -> list[str]:
    dead = []
    for md in markdown_files():
        if not md.exists():
            dead.append(f"{md.relative_to(REPO)}: missing")
            continue
        for n, line in enumerate(md.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue  # a URL or an anchor in the same page
                path = target.split("#", 1)[0]
                if not (md.parent / path).exists():
                    dead.append(f"{md.relative_to(REPO)}:{n}: link to {target}")
    history = history_runs()
    for src in source_files():
        for n, line in enumerate(src.read_text().splitlines(), 1):
            for path in RESULTS_PATH.findall(line):
                path = path.rstrip(".,;:")
                if (REPO / path).exists():
                    continue
                run = path[len("docs/results/"):].split("/", 1)[0]
                if src.name == "measurements.md" and run in history:
                    continue
                dead.append(f"{src.relative_to(REPO)}:{n}: {path} does not exist")
    return dead


def main() -> int:
    dead = dead_links()
    for line in dead:
        print(line)
    return 1 if dead else 0


if __name__ == "__main__":
    raise SystemExit(main())
