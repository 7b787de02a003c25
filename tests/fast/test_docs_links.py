"""The front page and the topic pages (README.md, SECURITY.md, docs/*.md): every relative link
and image points to a file that exists, and every #anchor to a heading of its page, as GitHub
names headings. A page moved or a heading renamed fails here, not in a reader's browser. And every
path of the repository that a page, a module's docstring or a test names (``tests/fast/...``) exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = next(folder for folder in Path(__file__).resolve().parents if (folder / "pyproject.toml").is_file())
PAGES = sorted([ROOT / "README.md", ROOT / "SECURITY.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`)(?:(?!\n[ \t]*\n)[\s\S])+?(?<!`)\1(?!`)")  # may wrap lines, not paragraphs
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[([^\]]+)\]:[ \t]*<?([^\s>]+)>?", re.MULTILINE)
REFERENCE_USE = re.compile(r"\]\[([^\]]+)\]")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
EXTERNAL = ("http://", "https://", "mailto:")


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans: a link inside code is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text as rendered (link targets, code and emphasis
    marks dropped), lower case, every character but letters, digits, ``_``, ``-`` and spaces
    removed, each space a ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of a markdown page: its headings' (a repeated one gets -1, -2, ... as on
    GitHub) and the explicit ``<a id=...>`` ones."""
    text = FENCE.sub("", page.read_text())
    found: set[str] = set(EXPLICIT_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for heading in HEADING.findall(text):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    """The targets of the page's inline links and images and of its reference definitions
    (``[name]: target``), in that order, without the external ones."""
    prose = _prose(page.read_text())
    targets = LINK.findall(prose) + [target for _, target in REFERENCE.findall(prose)]
    return [target for target in targets if not target.startswith(EXTERNAL)]


def undefined_references(page: Path) -> list[str]:
    """``[text][name]`` links whose ``[name]:`` is not defined: they would show as plain text."""
    prose = _prose(page.read_text())
    defined = {name.lower() for name, _ in REFERENCE.findall(prose)}
    return [name for name in REFERENCE_USE.findall(prose) if name.lower() not in defined]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
            broken.append(f"{target}: no heading #{anchor} in {linked}")
    return broken


def test_the_anchor_of_a_heading_is_githubs():
    assert github_anchor("Losing a node: replica-level fault tolerance (`--fault-tolerance replica`)") == (
        "losing-a-node-replica-level-fault-tolerance---fault-tolerance-replica"
    )
    assert github_anchor("1. CLI start-up (`bench_cli.py --runs 21`)") == "1-cli-start-up-bench_clipy---runs-21"
    assert github_anchor("See [the data](docs/data.md), **now**") == "see-the-data-now"


def test_a_missing_file_or_heading_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A part\n\n## A part\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n[ok](other.md#a-part) [ok too](other.md#a-part-1) [self](#page) ![img](other.md)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) [web](https://example.org/x#y)\n"
        "`[in code](nowhere.md)` and ``[in a code span\nover two lines](nowhere.md)``\n```\n[in a block](nowhere.md)\n```\n"
        "[by name][o] [by a lost name][lost]\n\n[o]: other.md#a-part\n[gone too]: missing-too.md\n"
    )
    assert relative_links(page) == [
        "other.md#a-part",
        "other.md#a-part-1",
        "#page",
        "other.md",
        "missing.md",
        "other.md#nowhere",
        "other.md#a-part",
        "missing-too.md",
    ]
    assert [line.split(":")[0] for line in broken_links(page)] == ["missing.md", "other.md#nowhere", "missing-too.md"]
    assert undefined_references(page) == ["lost"]


def test_there_are_topic_pages_and_the_readme_links_them():
    docs = {page.resolve() for page in (ROOT / "docs").glob("*.md")}
    assert docs, "no topic pages under docs/"
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in relative_links(ROOT / "README.md")}
    assert docs <= linked, f"topic pages the README does not point to: {sorted(p.name for p in docs - linked)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page), f"broken links in {page.relative_to(ROOT)}: " + "; ".join(broken_links(page))
    assert not undefined_references(page), (
        f"undefined link names in {page.relative_to(ROOT)}: {undefined_references(page)}"
    )


NAMED_PATH = re.compile(r"(?<![\w/.-])((?:tests|hpc_hsdp|benchmarks|docs|scripts|examples)/[\w./-]*\w)")
"""A path of the repository named in text (``tests/fast/test_options.py``, ``hpc_hsdp/job/options.py``)."""
NAMING = sorted(
    path
    for path in [
        *PAGES,
        ROOT / "sbatch" / "README.md",
        *(ROOT / "hpc_hsdp").rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "scripts").iterdir(),
    ]
    if path != Path(__file__).resolve()  # its own sample names a path that is gone
)
"""What names repository paths and should stay true (benchmarks/RESULTS.md is a log of past runs: not here)."""


def missing_paths(text: str) -> list[str]:
    """The repository paths ``text`` names that do not exist (a glob or a placeholder is no path)."""
    return [
        path
        for path in dict.fromkeys(NAMED_PATH.findall(text))
        if not any(mark in path for mark in ("*", "<", "..."))
        and not (ROOT / path).exists()
        and not (ROOT / path.rstrip(".")).exists()
    ]


def test_a_named_path_that_is_gone_is_found():
    text = "see tests/fast/test_options.py, tests/test_options.py and hpc_hsdp/job/nowhere.py; tests/*/x.py"
    assert missing_paths(text) == ["tests/test_options.py", "hpc_hsdp/job/nowhere.py"]


@pytest.mark.parametrize("path", NAMING, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_repository_path_named_exists(path):
    """A file moved (the tests into their tiers) leaves no page or docstring pointing at its old place."""
    assert not missing_paths(path.read_text(errors="replace")), (
        f"{path.relative_to(ROOT)} names paths that do not exist: {missing_paths(path.read_text(errors='replace'))}"
    )


def test_the_readme_installs_from_an_index_and_from_a_checkout_with_extras_that_exist():
    import tomllib  # noqa: PLC0415

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    lines = [line.split("#")[0].strip() for line in (ROOT / "README.md").read_text().splitlines()]
    installs = [line for line in lines if line.startswith("pip install ")]
    assert any("'hpc-hsdp[" in line for line in installs), installs  # from the package index
    assert any(line.startswith("pip install -e '.[") for line in installs), installs  # from a checkout
    for line in installs:
        named = re.search(r"\[([a-z0-9,-]+)\]'", line)
        assert named and set(named.group(1).split(",")) <= extras, line
