"""The command reference page (``cli-reference.md``), generated from the ``splitz`` argument parser itself when the
site is built, so it lists every command and option of the code it documents: an MkDocs hook (``hooks`` in
mkdocs.yml).

One heading per command (and per subcommand, a level deeper), the command's one-line summary, its synopsis on one
line (a formatter wide enough that argparse never wraps it; the page wraps it between items), then a table of its arguments: option, default, help.
"""
from __future__ import annotations

import argparse
import html
import re

#: Wide enough for the longest synopsis, so that argparse prints each on one line.
SYNOPSIS_WIDTH = 100_000
PAGE = "cli-reference.md"
TITLE = "Command reference"
INTRO = ("Generated from the `splitz` argument parser when this site is built, so every command and option of this "
         "version is here; `splitz COMMAND --help` prints the same. What the commands do, with examples: "
         "[Command line](cli.md).")
_MARKDOWN_SPECIALS = re.compile(r"([\\`*_\[\]|<>#])")


def _wide(formatter_class):
    """``formatter_class`` with a width that never wraps a synopsis."""
    return lambda prog: formatter_class(prog, width=SYNOPSIS_WIDTH)


def _text(value: str) -> str:
    """Plain text for a Markdown table cell: Markdown's special characters escaped, line breaks as spaces."""
    return _MARKDOWN_SPECIALS.sub(r"\\\1", " ".join(value.split()))


def _code(value: str) -> str:
    """``value`` as a code span in a table cell (a pipe inside a code span does not split the cell)."""
    return f"`{value}`"


def _synopsis(usage: str) -> str:
    """``usage`` as a ``<pre>`` whose top-level items (``[--batch BATCH]``, ``--sigma SIGMA``) are spans: the page's
    stylesheet (docs/stylesheets/cli-reference.css) wraps the line between items, never inside one."""
    items, depth, start = [], 0, 0
    for at, char in enumerate(usage):
        depth += (char in "[({") - (char in "])}")
        if char == " " and depth == 0:
            items.append(usage[start:at])
            start = at + 1
    items.append(usage[start:])
    spans = " ".join(f"<span>{html.escape(item)}</span>" for item in items if item)
    return f'<pre class="synopsis"><code>{spans}</code></pre>'


def _default(action: argparse.Action) -> str:
    """What an argument is when not given: "required", its default, or a dash where there is none to show."""
    if action.required or not action.option_strings and action.nargs not in ("?", "*"):
        return "required"
    if action.default in (None, argparse.SUPPRESS) or isinstance(action, argparse._StoreTrueAction):
        return "—"
    if isinstance(action.default, (list, tuple)):
        return _code(" ".join(map(str, action.default)))
    return _code(str(action.default))


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    """The table rows of ``parser``'s own arguments (a subcommand list is its own section, not a row)."""
    formatter = argparse.HelpFormatter(parser.prog, width=SYNOPSIS_WIDTH)  # help without "(default: …)": a column has it
    rows = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        invocation = formatter._format_action_invocation(action)
        help_text = formatter._expand_help(action) if action.help else ""
        rows.append(f"| {_code(invocation)} | {_default(action)} | {_text(help_text)} |")
    return rows


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[argparse.ArgumentParser, str]]:
    """``parser``'s subcommands with the one-line help each is listed with."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {choice.dest: choice.help or "" for choice in action._choices_actions}
            found += [(sub, summaries.get(name, "")) for name, sub in action.choices.items()]
    return found


def command_sections(parser: argparse.ArgumentParser, summary: str = "", level: int = 2) -> list[str]:
    """The Markdown lines of ``parser``'s section and, one level deeper, of each of its subcommands."""
    parser.formatter_class = _wide(parser.formatter_class)
    lines = [f"{'#' * level} {parser.prog}", ""]
    description = summary or parser.description or ""
    if description:
        lines += [_text(description), ""]
    lines += [_synopsis(parser.format_usage().strip()), ""]
    rows = _argument_rows(parser)
    if rows:
        lines += ["| argument | default | help |", "|---|---|---|", *rows, ""]
    for sub, sub_summary in _subcommands(parser):
        lines += command_sections(sub, sub_summary, level + 1)
    return lines


def command_names(parser: argparse.ArgumentParser) -> list[str]:
    """Every command's full name (``splitz``, ``splitz train``, …): the headings the page must have."""
    return [parser.prog, *(name for sub, _ in _subcommands(parser) for name in command_names(sub))]


def reference_page(parser: argparse.ArgumentParser) -> str:
    """The whole page for ``parser``."""
    return "\n".join([f"# {TITLE}", "", INTRO, "", *command_sections(parser)])


def on_files(files, config):
    """MkDocs hook: adds the generated page to the site's files (before the nav and the links are checked)."""
    from mkdocs.structure.files import File

    from splitz_fast.cli.main import build_parser

    files.append(File.generated(config, PAGE, content=reference_page(build_parser())))
    return files
