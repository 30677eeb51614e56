"""The documentation holds together: every relative link of README.md and docs/*.md reaches a
file (and, with `#anchor`, a heading of it), README.md stays short, and its contents table
lists docs files that exist. Serial and fast: it reads markdown, nothing else."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 500

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^()\s]+)\)|!\[[^\]]*\]\(([^()\s]+)\)")  # [text](target), ![alt](image)
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link and image outside fenced code and inline
    code spans; a link's text may run over a line break."""
    lines = [""] * len(text.splitlines())
    for number, line in prose_lines(text):
        lines[number - 1] = line
    # `[a](b)` is code, not a link; a code span may run over a line break (kept, for line numbers)
    prose = re.sub(r"`[^`]*`", lambda m: re.sub(r"[^\n]", " ", m.group(0)), "\n".join(lines))
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1) or m.group(2)) for m in LINK.finditer(prose)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, only letters, digits, spaces, hyphens and
    underscores kept, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading counts its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown file's headings (outside fenced code); a repeated heading gets
    -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """'file:line: target (why)' for each relative link of a markdown file that reaches no file,
    or no heading of the markdown file it names."""
    text = path.read_text()
    bad = []
    for number, target in links(text):
        if re.match(r"^(https?:|mailto:)", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{number}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{where} (no heading #{anchor} in {dest.name})")
        elif anchor and dest.suffix != ".md":
            bad.append(f"{where} (an anchor into a file that is not markdown)")
    return bad


def doc_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def test_every_relative_link_resolves():
    bad = [problem for path in doc_files() for problem in broken_links(path)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_link_check_finds_a_planted_broken_link(tmp_path):
    """The checker can fail: a missing file, a missing heading and a missing same-file anchor
    are named; a good link, a URL and a link inside a code block are not."""
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md#a-section) [ok too](other.md#a-section-1) [self](#page) [web](https://example.org/x)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) [no anchor](#absent) [over a\nline](gone.md)\n"
        "```\n[in code](missing_in_code.md)\n```\n"
        "`[inline](missing_inline.md)`\n"
    )
    bad = broken_links(page)
    assert [b.split(": ", 1)[1].split(" (")[0] for b in bad] == ["missing.md", "other.md#nowhere", "#absent", "gone.md"]


def test_slug_follows_githubs_rule():
    assert slug("Plan first: the dry run") == "plan-first-the-dry-run"
    assert slug("Fine-tuning from Hugging Face weights") == "fine-tuning-from-hugging-face-weights"
    assert slug("Simulated nodes (`launch/cluster_local.sh`)") == "simulated-nodes-launchcluster_localsh"
    assert slug("An example run on this machine: BPE, validation loss, a sample") == (
        "an-example-run-on-this-machine-bpe-validation-loss-a-sample"
    )


def test_readme_is_at_most_500_lines():
    count = len(README.read_text().splitlines())
    assert count <= README_MAX_LINES, f"README.md has {count} lines, more than {README_MAX_LINES}: move text to docs/"


def test_readme_contents_table_lists_docs_files_that_exist():
    """The README's contents table links each docs file it lists, each exists, and every docs
    file is in the table."""
    text = README.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| [docs/")]
    listed = [re.match(r"\| \[(docs/[^\]]+)\]\((docs/[^)#]+)\)", row) for row in rows]
    assert listed and all(m and m.group(1) == m.group(2) for m in listed), rows
    names = [m.group(1) for m in listed]
    for name in names:
        assert (REPO / name).is_file(), f"README.md lists {name}, which does not exist"
        assert f"]({name})" in text, f"README.md does not link {name}"
    required = {"CLUSTERS", "PARALLELISM", "DATA", "CHECKPOINT", "PERFORMANCE_MODEL", "TESTING", "ARCHITECTURE", "DECK"}
    assert {f"docs/{n}.md" for n in required} <= set(names)
    unlisted = sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md") if f"docs/{p.name}" not in names)
    assert not unlisted, f"docs files missing from README.md's contents table: {unlisted}"
