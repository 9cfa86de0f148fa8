"""The README and docs/: every relative link reaches a file and every #anchor a heading (GitHub's
heading slugs); the README stays short and starts with the quick start; the configuration
reference is the one the settings generate."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

import audio_pipeline.config_reference as reference

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
QUICK_START = ['scripts/quickstart.sh "Hello! This is audio pipeline speaking." hello.wav', "scripts/test.sh"]

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
#: A code span of prose, which may wrap across lines but not across a paragraph.
_WRAPPED_CODE_SPAN = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.DOTALL)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opened = _FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower case, without punctuation but
    hyphens and underscores, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = _CODE_SPAN.sub(r"\2", text)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(char for char in text if char.isalnum() or char in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text()):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """The link targets of a markdown file's prose (not its code), with their line numbers; a link's
    text may wrap across lines."""
    text = path.read_text()
    prose = dict(prose_lines(text))
    lines = [prose.get(number, "") for number in range(1, len(text.splitlines()) + 1)]
    # Code spans become blanks of their own length's lines, so the line numbers stay.
    joined = _WRAPPED_CODE_SPAN.sub(lambda match: "\n" * match.group(0).count("\n"), "\n".join(lines))
    return [(joined.count("\n", 0, match.start()) + 1, match.group(1)) for match in _LINK.finditer(joined)]


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http(s), mailto: not fetched
            continue
        file_part, _, anchor = target.partition("#")
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        destination = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not destination.exists():
            problems.append(f"{where}: no such file")
            continue
        if not anchor:
            continue
        if destination.suffix != ".md":
            problems.append(f"{where}: an anchor into a file that is not markdown")
        elif unquote(anchor) not in anchors(destination):
            problems.append(f"{where}: no heading #{anchor} in {destination.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_a_heading(page):
    assert broken_links(page) == []


def test_the_docs_are_linked_from_the_readme():
    linked = {(README.parent / target.partition("#")[0]).resolve() for _, target in links(README)}
    unlinked = [page.name for page in PAGES[1:] if page.resolve() not in linked]
    assert unlinked == [], f"docs pages the README does not link to: {unlinked}"


def test_the_readme_is_short_and_starts_with_the_quick_start():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; at most 200 (move details to docs/)"
    content = [line for line in lines if line.strip()]
    assert content[:3] == ["# audio-pipeline", "## Quick start", "```bash"], content[:3]
    block = content[3:content.index("```", 3)]
    assert block == QUICK_START


def test_slugs_follow_github():
    assert slug("HTTP (OpenAI-compatible speech)") == "http-openai-compatible-speech"
    assert slug("`model.kv_cache.cache_dtype`") == "modelkv_cachecache_dtype"
    assert slug("The `language` field") == "the-language-field"
    assert slug("Ray Serve replicas, measured") == "ray-serve-replicas-measured"


def test_the_configuration_reference_is_current():
    page = ROOT / reference.PAGE
    assert page.exists() and page.read_text() == reference.render(), (
        f"{reference.PAGE} is stale: regenerate it with `{reference.REGENERATE}`")


def test_the_configuration_reference_lists_every_setting_with_its_flag_and_variable():
    settings = {setting.name: setting for section in reference.sections() for setting in section.settings}
    assert settings["model.kv_cache.cache_dtype"].env == "AUDIO_PIPELINE_MODEL__KV_CACHE__CACHE_DTYPE"
    assert settings["model.model_path"].flag == "--model"
    assert settings["model.dtype"].flag == "--dtype"
    assert settings["audio_decoder_weights"].flag == "--audio-decoder-weights"
    assert settings["config_file"].flag == "--config-file"
    assert settings["sampling.temperature"].flag is None
    assert "limits.max_message_bytes" in settings and "model" not in settings and "limits" not in settings
