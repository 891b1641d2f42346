"""The documentation's relative links resolve, and the plugin guide's complete example is the fixture it quotes.

Every relative link in the README, ``docs/*.md`` and ``bench/README.md`` (``[text](path)``, ``[text](path#anchor)``,
``[text](#anchor)``, images, reference definitions and HTML ``<img src>``) must name an existing file or directory,
and an anchor must be a heading of its file under GitHub's slug rules. Code (fenced blocks and inline spans) is
not prose: brackets there are not links. External links are not fetched.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.DOTALL)
_INLINE = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.MULTILINE)
_IMG = re.compile(r"<img\b[^>]*\bsrc=[\"']([^\"']+)[\"']", re.IGNORECASE)
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks, and with each inline code span reduced to a word."""
    return _CODE_SPAN.sub("code", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lowercase, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    prose = _prose(path.read_text(encoding="utf-8"))
    return [*_INLINE.findall(prose), *_REFERENCE.findall(prose), *_IMG.findall(prose)]


def broken_links(path: Path) -> list[str]:
    """Each relative link of ``path`` that names no file, or an anchor its file has no heading for."""
    broken = []
    for link in links(path):
        if not link or _SCHEME.match(link) or link.startswith("//"):
            continue  # external (http, https, mailto): not fetched
        target, _, anchor = link.partition("#")
        resolved = (path.parent / unquote(target)).resolve() if target else path
        if not resolved.exists():
            broken.append(f"{link}: no such file")
        elif anchor and (not resolved.is_file() or resolved.suffix != ".md"):
            broken.append(f"{link}: an anchor into a file that has no headings")
        elif anchor and unquote(anchor).lower() not in anchors(resolved):
            broken.append(f"{link}: no heading #{anchor} in {resolved.name}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


def test_the_check_finds_broken_links_and_ignores_code(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading: with punctuation, `code` and CAPS\n\n## Twice\n\n## Twice\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](there.md) [ok](there.md#a-heading-with-punctuation-code-and-caps) [ok](there.md#twice-1) "
        "[ok](#local) [ok](https://example.invalid/x) ![ok](there.md)\n"
        "[gone](missing.md) [bad anchor](there.md#nowhere) ![gone image](missing.png) <img src=\"lost.png\">\n"
        "[ref]: also-missing.md\n\n"
        "# Local\n\n`[not a link](nowhere.md)`\n\n```python\nx = f[0](nowhere)\n[no](nowhere.md)\n```\n")
    assert [problem.split(":")[0] for problem in broken_links(doc)] == [
        "missing.md", "there.md#nowhere", "missing.png", "also-missing.md", "lost.png"]


def test_the_plugin_guide_quotes_the_echo_fixture_whole() -> None:
    """docs/plugins.md's complete example is the fixture the kit runs, so it cannot drift from working code."""
    guide = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    fixture = ROOT / "tests" / "fixtures" / "pocketllm-echo"
    for name, language in (("pyproject.toml", "toml"), ("src/pocketllm_echo/__init__.py", "python")):
        source = (fixture / name).read_text(encoding="utf-8")
        assert f"`{name}`:\n\n```{language}\n{source}```\n" in guide, f"docs/plugins.md does not quote {name} whole"
