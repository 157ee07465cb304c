"""The documentation site's build pieces (scripts/docs/, scripts/check_docs_site.py): the docstring-role rewriter on
sample docstrings, the command reference against the real parser, the page checks on sample HTML, and (slow) the
whole site built and checked."""
from __future__ import annotations

import argparse
import html
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "docs"))
sys.path.insert(0, str(ROOT / "scripts"))

import check_docs_site  # noqa: E402
from cli_reference import command_names, reference_page  # noqa: E402

from splitz_fast.cli.main import build_parser  # noqa: E402

SAMPLE_MODULE = '''"""The sample module: :class:`~pkg.shapes.Square`, :func:`area`, :mod:`.helpers`, :class:`torch.nn.Module`,
:meth:`Square.grow`, :class:`!Square`, :func:`the area <pkg.shapes.area>` and :class:`~pkg.shapes.
Square`."""


def area(side):
    """Uses :meth:`~pkg.shapes.Square.grow`."""


class Square:
    """See :meth:`grow` and :func:`nowhere`."""

    def grow(self):
        """Back to :class:`Square`."""
'''


@pytest.fixture
def sample_package(tmp_path):
    """A two-module package ``pkg`` loaded by Griffe with the role extension; returns (package, extension)."""
    griffe = pytest.importorskip("griffe", reason="the docs requirements (make .venv/.docs-installed)")
    from sphinx_roles import SphinxRoles

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""The package."""\n')
    (package / "helpers.py").write_text('"""Helpers."""\n')
    (package / "shapes.py").write_text(SAMPLE_MODULE)
    roles = SphinxRoles()
    loaded = griffe.load("pkg", search_paths=[str(tmp_path)], extensions=griffe.load_extensions(roles))
    return loaded, roles


def _link(target: str, title: str) -> str:
    return f'<autoref identifier="{target}" optional class="sphinx-role">`{title}`</autoref>'


def test_roles_become_links_to_full_paths(sample_package):
    package, roles = sample_package
    module = package["shapes"].docstring.value
    assert _link("pkg.shapes.Square", "Square") in module  # `~` shows the last component only
    assert _link("pkg.shapes.area", "area") in module  # a bare name, found in the docstring's module
    assert _link("pkg.helpers", "helpers") in module  # a leading dot, relative to the package
    assert _link("pkg.shapes.Square.grow", "Square.grow") in module
    assert _link("pkg.shapes.area", "the area") in module  # an explicit title
    assert module.endswith(f"and {_link('pkg.shapes.Square', 'Square')}.")  # a name broken over two lines
    assert _link("pkg.shapes.Square.grow", "grow") in package["shapes.area"].docstring.value
    assert _link("pkg.shapes.Square.grow", "grow") in package["shapes.Square"].docstring.value  # a class's member
    assert _link("pkg.shapes.Square", "Square") in package["shapes.Square.grow"].docstring.value


def test_unresolved_roles_are_plain_code_and_counted(sample_package):
    package, roles = sample_package
    module = package["shapes"].docstring.value
    assert "`torch.nn.Module`" in module and "`Square`," in module  # `!Square`: code, never linked
    assert "`nowhere`" in package["shapes.Square"].docstring.value
    assert ":class:" not in module and ":func:" not in package["shapes.Square"].docstring.value
    assert sorted(roles.unresolved) == [("pkg.shapes", ":class:`torch.nn.Module`"),
                                        ("pkg.shapes.Square", ":func:`nowhere`")]
    assert roles.rewritten == 9


def _parser_commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser under ``parser``, read straight from argparse (not through the generator)."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parser_commands(sub)
    return found


def test_reference_has_every_command_and_option_of_the_parser():
    page = reference_page(build_parser())
    commands = _parser_commands(build_parser())
    assert len(commands) >= 11 and command_names(build_parser()) == [c.prog for c in commands]
    headings = [line.lstrip("#").strip() for line in page.splitlines() if line.startswith("#")]
    for command in commands:
        assert command.prog in headings
        section = page.split(f" {command.prog}\n", 1)[1].split("\n#", 1)[0]
        usage = next(line for line in section.splitlines() if '<pre class="synopsis">' in line)
        assert html.unescape(re.sub("<[^>]+>", "", usage)) == " ".join(command.format_usage().split())  # one line
        for action in command._actions:
            if action.help != argparse.SUPPRESS and not isinstance(action, argparse._SubParsersAction):
                name = action.option_strings[-1] if action.option_strings else action.metavar or action.dest
                assert f"| `{name}" in section or f", {name}" in section, (command.prog, name)


def test_reference_synopsis_is_never_wrapped():
    page = reference_page(build_parser())
    certify = page.split("### splitz certify\n", 1)[1]
    usage = certify.split('<pre class="synopsis"><code>', 1)[1].split("</code></pre>", 1)[0]
    assert "\n" not in usage and "outfile" in usage.lower() and "--resume" in usage
    assert "<span>[--batch BATCH]</span> <span>" in usage  # the page may wrap between items, never inside one


def test_page_checks_find_raw_roles_and_outside_hosts():
    html = ('<html><head><link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">'
            '<script src="https://cdn.example.org/x.js"></script><script>var a = ":class:`x`";</script></head>'
            '<body><h2 id="a">splitz train<a class="headerlink" href="#a">¶</a></h2>'
            '<p>See :class:<code>Smoother</code>.</p><img src="../plot.png">'
            '<a class="autorefs sphinx-role" href="#x"><code>x</code></a></body></html>')
    page = check_docs_site.read_page(html)
    assert page.headings == ["splitz train"] and page.images == ["../plot.png"] and page.role_links == 1
    problems = check_docs_site.page_problems(page, "p.html")
    assert any("raw role ':class:'" in p for p in problems)
    assert any("fonts.googleapis" in p for p in problems) and any("cdn.example.org" in p for p in problems)
    assert len(problems) == 3  # the role inside <script> is not visible text
    clean = check_docs_site.read_page('<html><head><script src="assets/x.js"></script></head><body>'
                                      '<p>roles as links</p><img src="data:image/png;base64,AAAA"></body></html>')
    assert check_docs_site.page_problems(clean, "q.html") == []


@pytest.mark.slow
def test_built_site_checks_out(tmp_path, capsys):
    pytest.importorskip("mkdocs", reason="the docs requirements (make .venv/.docs-installed)")
    site = tmp_path / "site"
    check_docs_site.build(site)
    problems, role_links = check_docs_site.check_site(site, ROOT / "docs", command_names(build_parser()))
    assert problems == []
    assert role_links > 50  # the API reference links its roles
    api = check_docs_site.read_page((site / "api" / "index.html").read_text(encoding="utf-8"))
    assert "ClippedReLU" in " ".join(api.text) and not check_docs_site.RAW_ROLE.search(" ".join(api.text))
    home = check_docs_site.read_page((site / "index.html").read_text(encoding="utf-8"))
    assert any(src.endswith("envelope.png") for src in home.images)
