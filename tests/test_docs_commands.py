"""Every `dflash-ops ...` line in a fenced block of README.md and docs/*.md parses against the real
Click commands (options, their values, arguments), so a walk-through cannot teach a flag that does
not exist. Nothing runs: each line goes through click's `make_context` of the group and then of the
subcommand it names, callbacks not invoked. Also: every command's --help renders."""
from __future__ import annotations

import re
import shlex
import warnings
from pathlib import Path

import click
import pytest

from orchestrator.cli import cli

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```")


def fenced_command_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, command) for each `dflash-ops ...` line inside a fence; a line ending in `\\`
    continues on the next; a `$ ` prompt is dropped."""
    found, inside, pending, start = [], False, "", 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        text = line.strip().removeprefix("$ ")
        if pending:
            text, pending = pending + " " + text, ""
        elif not text.startswith("dflash-ops "):
            continue
        else:
            start = n
        if text.endswith("\\"):
            pending = text[:-1].rstrip()
            continue
        found.append((start, text))
    return found


CASES = [pytest.param(line, id=f"{p.relative_to(REPO)}:{n}") for p in DOCS for n, line in fenced_command_lines(p)]


def parse(words: list[str]) -> None:
    """As `dflash-ops WORDS` would parse, without running: the group's options, then the subcommand's."""
    with cli.make_context("dflash-ops", list(words), resilient_parsing=False) as ctx:
        with warnings.catch_warnings():     # click 8.2-8.x: the subcommand's words are still there
            warnings.simplefilter("ignore", DeprecationWarning)
            remaining = [*ctx.protected_args, *ctx.args]
        name, cmd, rest = cli.resolve_command(ctx, remaining)
        try:
            cmd.make_context(name, rest, parent=ctx, resilient_parsing=False).close()
        except click.exceptions.Exit:    # --help, --version: eager and fine
            pass


def test_the_collector_finds_the_walk_through_and_continued_lines():
    assert len(CASES) > 40
    for doc in ("README.md", "docs/train-your-model.md"):
        lines = [line for _, line in fenced_command_lines(REPO / doc)]
        walk_through = "dflash-ops launch ct200 --gpus 8 --config configs/qwen3-8b.yaml --gate --follow -- "
        assert any(line.startswith(walk_through)
                   and "--target /models/MyModel" in line for line in lines), doc


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings (outside fences): lower case, spaces to
    `-`, punctuation but `-` and `_` dropped."""
    found, inside = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_each_relative_link_reaches_a_file_and_its_heading(doc):
    """README sends a newcomer to docs/ by links; a moved section must not leave one dangling."""
    bad = []
    for target in LINK.findall(doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor in {dest.relative_to(REPO)}")
    assert not bad, bad


@pytest.mark.parametrize("line", CASES)
def test_each_documented_command_parses(line):
    words = shlex.split(line, comments=True)
    assert words[0] == "dflash-ops"
    try:
        parse(words[1:])
    except click.UsageError as e:
        pytest.fail(f"`{line}`: {e.format_message()}")


def test_a_line_with_a_missing_option_is_caught():
    with pytest.raises(click.NoSuchOption):
        parse(["logs", "--no-such-flag"])


def _commands():
    return sorted(cli.list_commands(None))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", _commands())
def test_help_renders_and_shows_no_bare_letter_as_a_default(name):
    with cli.make_context("dflash-ops", [name]) as ctx:
        cmd = cli.get_command(ctx, name)
        text = cmd.get_help(click.Context(cmd, info_name=name, parent=ctx))
    assert not re.search(r"\[default: \w\]", text), text
