"""A griffe extension for the API pages: the docstrings use Sphinx roles
(``:class:`Settings```), which Markdown would print literally; they become code spans.
``~a.b.C`` keeps only ``C``, as Sphinx shows it."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _span(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring's Sphinx roles into Markdown code spans."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_span, obj.docstring.value)
