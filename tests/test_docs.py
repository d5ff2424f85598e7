"""The documentation checks itself: README.md, CHANGELOG.md and docs/.

- A command marked runnable parses: every `$ ` line of a ```console block that runs `specwire`
  parses with the CLI's own parser (its subcommands and flags exist, values have their types),
  `make` names targets of the Makefile, and `python -m MODULE` uses only flags its `--help` lists.
  Blocks tagged otherwise (```bash, ```text) are illustrations, with placeholders, and not checked.
- Internal links resolve: a relative path names a file or folder of the repository, and an anchor
  (`page.md#heading` or `#heading`) names a heading of that page, as GitHub spells its anchors.
- A ```python block is valid Python.
- Generated tables are up to date with their `specwire bench --json` reports
  (`specwire report --refresh PAGE` rewrites them).
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from specwire.bench.report import refresh
from specwire.client.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
LINK = re.compile(r"!?\[(?:[^\]`]|`[^`]*`)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s+<?(\S+?)>?(?:\s|$)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`[^`]*`")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", "(", ")"}
REDIRECTIONS = {">", ">>", "<", "2>", "&>"}


def relative(page: Path) -> str:
    return str(page.relative_to(ROOT))


@dataclass(frozen=True)
class Line:
    number: int
    text: str
    fence: str | None  # the info string of the code block the line is in; None outside code


def lines_of(page: Path) -> Iterator[Line]:
    """Each line with the code block it sits in (the fence lines themselves count as code)."""
    fence: str | None = None
    for number, text in enumerate(page.read_text().splitlines(), start=1):
        opening = FENCE.match(text)
        if opening and fence is None:
            fence = opening[2] or "text"
            yield Line(number, text, fence)
        elif opening and fence is not None:
            yield Line(number, text, fence)
            fence = None
        else:
            yield Line(number, text, fence)


def console_commands(page: Path) -> Iterator[tuple[int, str]]:
    """(line number, command) for every `$ ` line of a ```console block, continuations joined."""
    pending: tuple[int, str] | None = None
    for line in lines_of(page):
        if line.fence != "console" or FENCE.match(line.text):
            continue
        text = line.text.strip()
        if pending is not None:
            pending = (pending[0], pending[1] + " " + text.removesuffix("\\"))
        elif text.startswith("$ "):
            pending = (line.number, text[2:].removesuffix("\\"))
        if pending is not None and not text.endswith("\\"):
            yield pending
            pending = None


def simple_commands(command: str) -> Iterator[list[str]]:
    """The words of each simple command in a shell line: split at operators, without
    redirections, comments or leading VAR=value assignments."""
    # Not POSIX mode: quotes stay on the tokens, so a quoted ")" is a word and not an operator;
    # each word is unquoted afterwards.
    lexer = shlex.shlex(command, posix=False, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words: list[str] = []
    tokens = iter(lexer)
    for token in tokens:
        if token in SHELL_OPERATORS:
            if words:
                yield words
            words = []
        elif token in REDIRECTIONS:
            next(tokens, None)
        elif words or not ENV_ASSIGNMENT.match(token):
            words.append("".join(shlex.split(token)))
    if words:
        yield words


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {name for line in text.splitlines() if (match := re.match(r"^([\w.-]+):", line)) for name in [match[1]]}


def parse_error(words: list[str]) -> str | None:
    """Why the command does not parse, or None when it does."""
    program = Path(words[0]).name
    if program == "specwire":
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(words[1:])
        except SystemExit as exit_:
            return None if exit_.code == 0 else stderr.getvalue().strip().splitlines()[-1]
        return None
    if program == "make":
        unknown = [target for target in words[1:] if not target.startswith("-") and target not in makefile_targets()]
        return f"no Makefile target {unknown}" if unknown else None
    if program.startswith("python") and words[1:2] == ["-m"]:
        help_text = subprocess.run(
            [sys.executable, "-m", words[2], "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        if help_text.returncode != 0:
            return f"`python -m {words[2]} --help` failed: {help_text.stderr.strip()[-200:]}"
        flags = {word.partition("=")[0] for word in words[3:] if word.startswith("--")}
        missing = sorted(flag for flag in flags if not re.search(re.escape(flag) + r"\b", help_text.stdout))
        return f"flags not in its --help: {missing}" if missing else None
    return None  # another program (git, kubectl, docker, openssl, …): not ours to check


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in lines_of(page):
        heading = HEADING.match(line.text) if line.fence is None else None
        if heading:
            base = github_anchor(heading[2])
            anchor, count = base, 1
            while anchor in found:  # GitHub numbers repeated headings: name, name-1, name-2
                anchor, count = f"{base}-{count}", count + 1
            found.add(anchor)
    return found


def links(page: Path) -> Iterator[tuple[int, str]]:
    for line in lines_of(page):
        if line.fence is not None:
            continue
        prose = INLINE_CODE.sub("", line.text)
        for match in [*LINK.finditer(prose), *filter(None, [REFERENCE.match(prose)])]:
            yield line.number, match[1]


def link_error(page: Path, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: …: not internal
        return None
    path_text, _, anchor = target.partition("#")
    path = (page.parent / path_text).resolve() if path_text else page
    if not path.exists():
        return f"no such file: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
    if not path.is_relative_to(ROOT):
        return "points outside the repository"
    if anchor and path.suffix == ".md" and anchor not in anchors(path):
        return f"no heading with anchor #{anchor} in {relative(path)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_runnable_commands_parse_against_the_cli(page: Path) -> None:
    failures = [
        f"{relative(page)}:{number}: `{' '.join(words)}`: {error}"
        for number, command in console_commands(page)
        for words in simple_commands(command)
        if (error := parse_error(words))
    ]
    assert not failures, "\n".join(failures)


def python_blocks(page: Path) -> Iterator[tuple[int, str]]:
    """(first line number, code) of every ```python block."""
    block: list[str] = []
    start = 0
    for line in lines_of(page):
        if line.fence == "python" and FENCE.match(line.text):
            if block or start:
                yield start, "\n".join(block)
                block, start = [], 0
            else:
                start = line.number + 1
        elif line.fence == "python":
            block.append(line.text)


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_python_examples_are_valid_python(page: Path) -> None:
    for start, code in python_blocks(page):
        try:
            ast.parse(code)
        except SyntaxError as error:
            pytest.fail(f"{relative(page)}:{start + (error.lineno or 1) - 1}: {error.msg}")


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_internal_links_resolve(page: Path) -> None:
    failures = [
        f"{relative(page)}:{number}: ({target}) {error}"
        for number, target in links(page)
        if (error := link_error(page, target))
    ]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_generated_tables_match_their_reports(page: Path) -> None:
    text = page.read_text()
    assert refresh(text, ROOT) == text, f"stale tables: run `specwire report --refresh {relative(page)}`"


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"
    assert any(number for number, _ in console_commands(ROOT / "README.md")), "the README shows no runnable command"


def test_the_checks_catch_what_they_should(tmp_path: Path) -> None:
    """Negative controls: a wrong flag, an unknown target, a missing page and a missing anchor."""
    assert parse_error(["specwire", "generate", "--prompt", "x", "--no-such-flag"]) is not None
    assert parse_error(["specwire", "generate", "--prompt", "x", "--max-new-tokens", "many"]) is not None
    assert parse_error(["specwire", "generate", "--prompt", "x", "--max-new-tokens", "8"]) is None
    assert parse_error(["make", "no-such-target"]) is not None
    assert list(simple_commands("OMP_NUM_THREADS=1 specwire up --port 1 & # a comment")) == [
        ["specwire", "up", "--port", "1"]
    ]
    assert list(simple_commands('echo "a)" > out && specwire generate --prompt "x y"')) == [
        ["echo", "a)"], ["specwire", "generate", "--prompt", "x y"]
    ]
    page = ROOT / "docs" / "x.md"  # resolved against docs/, never written
    assert link_error(page, "no-such-page.md") is not None
    assert link_error(page, "../README.md#no-such-heading") is not None
    assert github_anchor("Speculation that pays: auto γ, `--rtt-ms` & co.") == "speculation-that-pays-auto-γ---rtt-ms--co"
