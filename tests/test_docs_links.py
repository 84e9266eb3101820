"""Every relative link in the README, docs/ and the package READMEs points at a file that exists,
and a ``#anchor`` at a heading of that file (GitHub's heading ids)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("*/README.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(page.read_text()):
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = _slug(heading.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for line in _prose(page.read_text()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # not inside a code span
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{target} (no such heading)")
    return broken


def test_every_relative_link_in_the_docs_resolves() -> None:
    assert len(PAGES) > 5
    broken = {str(page.relative_to(ROOT)): links for page in PAGES if (links := broken_links(page))}
    assert not broken, broken


def test_the_anchor_rule_is_githubs() -> None:
    assert _slug("Model status for clients (`/models`, the llama.cpp router's API; `router.admin_keys`)") == (
        "model-status-for-clients-models-the-llamacpp-routers-api-routeradmin_keys")
    assert _slug("`models.<name>` (and `defaults`, merged under every model)") == (
        "modelsname-and-defaults-merged-under-every-model")


def test_every_code_block_is_closed() -> None:
    """An unclosed fence turns the rest of a page into code (a cut while moving text did that to the README)."""
    unclosed = [page.relative_to(ROOT).as_posix() for page in PAGES
                if sum(line.lstrip().startswith("```") for line in page.read_text().splitlines()) % 2]
    assert not unclosed, f"a code block is never closed in {unclosed}"
