"""The README is what a new user runs first: its Python snippet runs as written, every `splitz` command it (and the
getting-started page) shows is one the command line accepts, and it stays short and free of working history."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HISTORY = re.compile(r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth) session"
                     r"|issue #\d", re.IGNORECASE)


def _blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.DOTALL)


def _splitz_commands(path: Path) -> list[list[str]]:
    commands = []
    for block in _blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("splitz "):
                commands.append(shlex.split(line)[1:])
    return commands


def test_readme_python_snippet_runs(capsys):
    (snippet,) = _blocks(ROOT / "README.md", "python")
    exec(compile(snippet, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 4  # the certificate, then one line per input of certify_many


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_every_splitz_command_shown_parses(page):
    from splitz_fast.cli.main import build_parser

    commands = _splitz_commands(ROOT / page)
    assert len(commands) >= 5
    parser = build_parser()
    for argv in commands:
        args = parser.parse_args(argv)  # an unknown option or a missing argument exits here
        assert callable(args.func), argv


def test_readme_is_short_and_tells_no_working_history():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    for path in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found = HISTORY.search(path.read_text(encoding="utf-8"))
        assert found is None, f"{path.name}: {found.group(0)!r}"


def test_the_api_reference_documents_every_public_name():
    import splitz_fast as sz

    reference = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^::: splitz_fast\.(?:[\w]+\.)*?(\w+)$", reference, flags=re.MULTILINE))
    missing = sorted(set(sz.__all__) - documented)
    assert not missing, f"add to docs/api.md: {missing}"
