"""Checks the built documentation site as a reader gets it: ``python scripts/check_docs_site.py`` builds it (strict,
into a temporary folder) and checks it; ``--site site`` checks one already built (``make docs`` does that).

It fails (exit status 1, one line per problem) where
* a page's visible text holds a raw Sphinx role (``:class:``, ``:func:``, …) that the docstring extension missed;
* an ``<img src>`` is not a file of the site, or a plot under docs/ is shown on no page;
* a ``splitz`` command (from the parser itself) has no heading on the command reference page;
* a page loads a font, a stylesheet or a script from another host (the site must read offline).
It prints how many roles the docstrings hold, how many became links and which name nothing in the package.

Pages are read with the standard library's HTML parser, not a browser: no headless browser can be had offline here
(Playwright downloads its browser builds from outside the package registries, and the machines have no Chromium), so
"visible text" is the text outside ``<script>``, ``<style>`` and ``<head>``, as a browser would show it without CSS.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "docs"))

from cli_reference import PAGE as REFERENCE_PAGE  # noqa: E402
from cli_reference import command_names  # noqa: E402

RAW_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`?")
FONT_HOSTS = ("fonts.googleapis", "fonts.gstatic")
_HIDDEN = {"script", "style", "head", "template"}
_HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}


@dataclass
class Page:
    """What a reader of one HTML page sees and what the page loads."""

    text: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    headings: list[str] = field(default_factory=list)
    loads: list[str] = field(default_factory=list)  # URLs of the stylesheets, fonts, icons and scripts it loads
    role_links: int = 0


class _PageParser(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self._hidden = 0
        self._heading: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in _HIDDEN:
            self._hidden += 1
        if tag == "script" and attrs.get("src"):
            self.page.loads.append(attrs["src"])
        if tag == "link" and attrs.get("href") and attrs.get("rel") != "canonical":
            self.page.loads.append(attrs["href"])
        if tag == "img" and attrs.get("src"):
            self.page.images.append(attrs["src"])
        if tag == "a" and "sphinx-role" in (attrs.get("class") or "").split():
            self.page.role_links += 1
        if tag in _HEADINGS:
            self._heading = []

    def handle_endtag(self, tag):
        if tag in _HIDDEN:
            self._hidden -= 1
        if tag in _HEADINGS and self._heading is not None:
            self.page.headings.append("".join(self._heading).replace("¶", "").strip())
            self._heading = None

    def handle_data(self, data):
        if self._hidden:
            return
        self.page.text.append(data)
        if self._heading is not None:
            self._heading.append(data)


def read_page(html: str) -> Page:
    """The parts of ``html`` the checks read."""
    parser = _PageParser()
    parser.feed(html)
    parser.close()
    return parser.page


def is_external(url: str) -> bool:
    """Whether loading ``url`` reaches another host (``https://…``, ``//host/…``); ``data:`` URIs load nothing."""
    parts = urlsplit(url)
    return bool(parts.netloc) or parts.scheme not in ("", "data")


def page_problems(page: Page, name: str) -> list[str]:
    """The problems of one page that need nothing but the page."""
    problems = []
    for raw in sorted(set(RAW_ROLE.findall(" ".join(page.text)))):
        problems.append(f"{name}: raw role {raw!r} in the page's text (scripts/docs/sphinx_roles.py did not rewrite it)")
    for url in page.loads + page.images:
        if is_external(url) or any(host in url for host in FONT_HOSTS):
            problems.append(f"{name}: loads {url} from another host (the site must read offline)")
    return problems


def _image_file(html_file: Path, src: str) -> Path:
    """The file an ``<img src>`` of ``html_file`` loads."""
    return (html_file.parent / unquote(urlsplit(src).path)).resolve()


def check_site(site: Path, docs: Path, commands: list[str]) -> tuple[list[str], int]:
    """Every problem of the built ``site`` (built from ``docs``), and the number of links made from roles."""
    problems, shown, role_links = [], set(), 0
    for html_file in sorted(site.rglob("*.html")):
        name = str(html_file.relative_to(site))
        page = read_page(html_file.read_text(encoding="utf-8"))
        role_links += page.role_links
        problems += page_problems(page, name)
        for src in page.images:
            if is_external(src):
                continue
            image = _image_file(html_file, src)
            if not image.is_file():
                problems.append(f"{name}: <img src={src!r}> is not a file of the site")
            shown.add(image)
        if html_file.relative_to(site).parent == Path(REFERENCE_PAGE).with_suffix(""):
            missing = [command for command in commands if command not in page.headings]
            problems += [f"{name}: no heading for the command `{command}`" for command in missing]
    for plot in sorted(docs.rglob("*.png")):
        if (site / plot.relative_to(docs)).resolve() not in shown:
            problems.append(f"{plot.relative_to(ROOT)}: shown on no page (add it where its results are discussed)")
    if not (site / Path(REFERENCE_PAGE).with_suffix("") / "index.html").is_file():
        problems.append(f"{REFERENCE_PAGE}: not in the built site (the hook in mkdocs.yml did not run)")
    for asset in [*site.rglob("*.css"), *site.rglob("*.js")]:
        text = asset.read_text(encoding="utf-8", errors="replace")
        problems += [f"{asset.relative_to(site)}: names {host}" for host in FONT_HOSTS if host in text]
    return problems, role_links


def role_counts():
    """The docstrings' roles as the site renders them: the extension run over the whole package."""
    import griffe
    from sphinx_roles import SphinxRoles

    roles = SphinxRoles()
    griffe.load("splitz_fast", search_paths=[str(ROOT)], extensions=griffe.load_extensions(roles),
                resolve_aliases=False)
    return roles


def build(site: Path) -> None:
    """``mkdocs build --strict`` into ``site``."""
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
                   cwd=ROOT, check=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, help="a site already built (make docs: site); unset, build one")
    args = parser.parse_args(argv)
    from splitz_fast.cli.main import build_parser

    with tempfile.TemporaryDirectory() as scratch:
        site = args.site or Path(scratch) / "site"
        if args.site is None:
            build(site)
        problems, role_links = check_site(site, ROOT / "docs", command_names(build_parser()))
    roles = role_counts()
    print(f"docstring roles: {roles.rewritten + len(roles.unresolved)}, resolved {roles.rewritten} "
          f"({role_links} links on the site's pages, the rest name objects no page renders: plain code), "
          f"naming nothing in the package {len(roles.unresolved)} (plain code):")
    for path, role in roles.unresolved:
        print(f"  {path}: {role}")
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(problems)} problems" if problems else "the site checks out")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
