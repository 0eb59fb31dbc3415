"""The documentation's links land: every relative link in README.md, docs/ and the folders' READMEs names a file
that exists and, into a Markdown page, a heading that page has (GitHub's anchors)."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_mpi  # the documents, not the MPI library

REPO = Path(__file__).parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")),
         *sorted(path for path in REPO.glob("*/README.md") if path.parent.name != "docs")]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"#{1,6}\s+(.*?)\s*#*\s*$")


def outside_code_blocks(page: Path):
    """(line number, line) of `page` outside ``` fences."""
    fenced = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup dropped, lower case, punctuation but - and _ dropped,
    spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for _, line in outside_code_blocks(page):
        if match := HEADING.match(line):
            name = anchor(match.group(1))
            found.add(f"{name}-{seen[name]}" if name in seen else name)  # a repeated heading gets -1, -2, ...
            seen[name] = seen.get(name, 0) + 1
    return found


def test_every_relative_link_names_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for number, line in outside_code_blocks(page):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                path, _, name = target.partition("#")
                linked = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(REPO)}:{number}: {target}"
                if not linked.exists():
                    broken.append(f"{where} (no such file)")
                elif name and linked.suffix == ".md" and name not in anchors(linked):
                    broken.append(f"{where} (no such heading)")
    assert len(PAGES) > 10 and broken == []
