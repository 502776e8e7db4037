"""griffe extension: Sphinx cross-reference roles in docstrings, rendered as links.

The docstrings are Google style but cite other objects the Sphinx way (``:class:`BatchPlan```,
``:meth:`Algorithm.aggregate```, ``:func:`~lightning_fedmeta.models.default_model```), which
Markdown would print literally. This extension turns each role into an mkdocs-autorefs
reference to the object, resolved in the docstring's own scope as Python would: a link when that
object is rendered on some page of the API reference, plain code otherwise (``optional``, so a
reference to an undocumented helper never fails the strict build). ``~`` shows the last name only.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|obj|exc|const):`(?P<tilde>~?)(?P<target>[\w.]+)`")


def _identifier(scope: griffe.Object, target: str) -> str:
    first, _, rest = target.partition(".")
    try:
        path = scope.resolve(first)
    except griffe.NameResolutionError:
        return target
    return f"{path}.{rest}" if rest else path


def _rewrite(obj: griffe.Object) -> None:
    if obj.docstring is not None and ":" in obj.docstring.value:
        def link(m: re.Match[str]) -> str:
            target = m.group("target")
            shown = target.rsplit(".", 1)[-1] if m.group("tilde") else target
            return f'<autoref identifier="{_identifier(obj, target)}" optional><code>{shown}</code></autoref>'

        obj.docstring.value = ROLE.sub(link, obj.docstring.value)
    for member in obj.members.values():
        if not member.is_alias:
            _rewrite(member)  # type: ignore[arg-type]


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:  # griffe 2
        _rewrite(pkg)

    def on_package_loaded(self, *, pkg: griffe.Module, **kwargs: Any) -> None:  # griffe 1 (idempotent)
        _rewrite(pkg)
