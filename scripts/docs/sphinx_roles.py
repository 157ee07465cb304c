"""Sphinx cross-reference roles in docstrings (``:class:`~splitz_fast.x.Y```, ``:func:`check_pool```, ``:mod:`.demo```,
…) rewritten as mkdocs-autorefs links: a Griffe extension that mkdocstrings-python loads (``extensions`` in
mkdocs.yml).

Each role's target is resolved the way Sphinx resolves it, against the Griffe tree of the package: the name inside the
docstring's own class and module, then in each enclosing module up to the package root, then as an absolute dotted
path, then (for a dotted name) as the unique object whose path ends with it. The title follows Sphinx too: the target
as written without leading dots, its last component alone after ``~``, an explicit ``title <target>`` as given.

A resolved role becomes an *optional* autoref to the object's canonical path: a link where some page renders that
object, plain code (no link, no warning, so ``--strict`` holds) where none does. A role whose target is nothing in the
package (``torch.nn.Module``, a mistyped name) becomes plain code and is counted in :attr:`SphinxRoles.unresolved`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from griffe import Alias, AliasResolutionError, CyclicAliasError, Extension, Module, Object

#: One Sphinx Python-domain role: ``:class:`…```, ``:py:func:`…```, with an optional ``title <target>`` body.
ROLE = re.compile(r":(?:py:)?(?P<role>class|func|meth|mod|attr|data|exc|obj|const):`(?P<body>[^`]+)`")
#: The HTML class of a link made from a role (scripts/check_docs_site.py counts them).
LINK_CLASS = "sphinx-role"
_EXPLICIT_TITLE = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.DOTALL)


@dataclass(frozen=True)
class RoleText:
    """A role's parts: what the reader sees, and the target name to resolve (leading ``~``, ``!`` and dots removed;
    ``relative`` when the name started with a dot)."""

    title: str
    target: str
    relative: bool
    linkable: bool


def parse_role_body(body: str) -> RoleText:
    """Title and target of a role's body, by Sphinx's rules (``PyXRefRole.process_link``)."""
    explicit = _EXPLICIT_TITLE.match(body)
    if explicit:
        title, target = explicit["title"], explicit["target"]
    else:
        title = target = body
    linkable = not target.startswith("!")  # Sphinx's `!name`: shown as code, never linked
    target = "".join(target.split()).lstrip("!~")  # a dotted name broken over two docstring lines is one name
    relative = target.startswith(".")
    target = target.lstrip(".")
    if not explicit:
        title = "".join(title.split()).lstrip("!").lstrip(".")
        if title.startswith("~"):
            title = title[1:].rsplit(".", 1)[-1]
    return RoleText(title=title, target=target, relative=relative, linkable=linkable)


def _canonical(collection, path: str) -> str | None:
    """The canonical path of the object at ``path`` (an alias followed to its target), or None where there is none."""
    try:
        found = collection[path]
        return (found.final_target if isinstance(found, Alias) else found).path
    except (KeyError, ValueError, AliasResolutionError, CyclicAliasError):
        return None


def _scopes(obj: Object) -> list[str]:
    """The paths a name in ``obj``'s docstring is looked up in, innermost first (a function's scope is its parent)."""
    scope = obj if obj.is_class or obj.is_module else obj.parent
    paths = []
    while scope is not None:
        paths.append(scope.path)
        scope = scope.parent
    return paths


class TargetResolver:
    """Resolves role targets against one loaded package (its objects, with their aliases followed)."""

    def __init__(self, package: Module):
        self._collection = package.modules_collection
        self._paths = [member.path for member in _objects(package)]

    def resolve(self, obj: Object, role: RoleText) -> str | None:
        """The canonical path ``role`` names from ``obj``'s docstring, or None where it names nothing here."""
        for scope in _scopes(obj):
            found = _canonical(self._collection, f"{scope}.{role.target}")
            if found:
                return found
        found = _canonical(self._collection, role.target)
        if found:
            return found
        if role.relative or "." in role.target:
            suffix = "." + role.target
            matches = {path for path in self._paths if path.endswith(suffix)}
            if len(matches) == 1:
                return matches.pop()
        return None


def _objects(obj: Object):
    """``obj`` and every object defined under it (aliases, i.e. imported names, left out: they are defined elsewhere)."""
    yield obj
    for member in obj.members.values():
        if not isinstance(member, Alias):
            yield from _objects(member)


def _code(text: str) -> str:
    """``text`` as a Markdown code span (longer fences where it holds a backtick)."""
    fence = "``" if "`" in text else "`"
    return f"{fence}{text}{fence}"


class SphinxRoles(Extension):
    """The Griffe extension: rewrites the roles of every docstring in each package Griffe loads.

    ``rewritten`` counts roles turned into links (optional autorefs); ``unresolved`` lists ``(object path, role)``
    for those that name nothing in the package, shown as plain code."""

    def __init__(self):
        super().__init__()
        self.rewritten = 0
        self.unresolved: list[tuple[str, str]] = []

    def on_package(self, *, pkg: Module, **kwargs) -> None:
        resolver = TargetResolver(pkg)
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = self.rewrite(obj.docstring.value, obj, resolver)

    def rewrite(self, text: str, obj: Object, resolver: TargetResolver) -> str:
        """``text`` with each role as an autoref (resolved) or plain code (not)."""

        def replace(match: re.Match) -> str:
            role = parse_role_body(match["body"])
            target = resolver.resolve(obj, role) if role.linkable else None
            if target is None:
                if role.linkable:
                    self.unresolved.append((obj.path, match[0]))
                return _code(role.title)
            self.rewritten += 1
            return f'<autoref identifier="{target}" optional class="{LINK_CLASS}">{_code(role.title)}</autoref>'

        return ROLE.sub(replace, text)
