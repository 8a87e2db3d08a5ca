"""Every relative link in README.md, BENCHMARKS.md and docs/*.md points to a file (or folder) that
exists, and every `#anchor` to a heading of the file it names."""

from __future__ import annotations

import os
import re

import pytest
from locations import ROOT

DOCS = ["README.md", "BENCHMARKS.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without fenced blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens (duplicates: -1, -2...)."""
    with open(path) as f:
        headings = re.findall(r"^#{1,6}\s+(.*?)\s*$", re.sub(r"^```.*?^```", "", f.read(), flags=re.S | re.M), re.M)
    seen: dict[str, int] = {}
    out = set()
    for heading in headings:
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_points_to_something_that_exists(doc: str) -> None:
    path = os.path.join(ROOT, doc)
    with open(path) as f:
        links = LINK.findall(_prose(f.read()))
    broken = []
    for link in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        file = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        if not os.path.exists(file):
            broken.append(f"{link}: no {os.path.relpath(file, ROOT)}")
        elif anchor and file.endswith(".md") and anchor not in _anchors(file):
            broken.append(f"{link}: no heading #{anchor} in {os.path.relpath(file, ROOT)}")
    assert not broken, f"{doc}: {broken}"


def test_the_architecture_map_lists_every_subpackage_of_refit() -> None:
    """docs/ARCHITECTURE.md's map has one row per subpackage of src/refit/, and no row for one that is gone."""
    src = os.path.join(ROOT, "src", "refit")
    packages = sorted(d for d in os.listdir(src) if os.path.isfile(os.path.join(src, d, "__init__.py")))
    with open(os.path.join(ROOT, "docs", "ARCHITECTURE.md")) as f:
        rows = re.findall(r"^\| `(\w+)/` \|", f.read(), flags=re.M)
    assert sorted(rows) == packages, (rows, packages)
