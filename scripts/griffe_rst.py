"""A griffe extension for the docs site: the reStructuredText left in jddp's docstrings as Markdown.

The docstrings are Google style but name objects with Sphinx roles (``:func:`plan_buckets```)
and introduce examples with ``::``. mkdocstrings renders Markdown, so each role becomes inline
code and a trailing ``::`` a colon (the indented block after it is already a Markdown code block).
mkdocs.yml loads this file as a griffe extension of the python handler.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj):`~?([^`]+)`")
_LITERAL = re.compile(r"(\S)::\n", re.MULTILINE)
_BARE_LITERAL = re.compile(r"^(\s*)::\n", re.MULTILINE)


def markdown(text: str) -> str:
    """``text`` with Sphinx roles as inline code and ``::`` literal-block markers as colons."""
    text = _ROLE.sub(r"`\1`", text)
    text = _BARE_LITERAL.sub("\n", text)
    return _LITERAL.sub(r"\1:\n", text)


class RstToMarkdown(griffe.Extension):
    """Rewrites every docstring that griffe loads (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
