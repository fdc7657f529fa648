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


_SIGNATURE = re.compile(r"^(?P<name>\w+)\((?P<params>.*)\)\s*(?:->\s*(?P<returns>.+))?$")


class CallableAttributes(griffe.Extension):
    """Documents an instance attribute that is called like a method (``DataParallel.step``, a
    compiled step object) as a method: its docstring's first paragraph is its signature,
    ``step(state, batch, mask=None, *, sync=None, rng=None) -> ...``, and the rest its docstring (Args,
    Returns, Raises), so the API page lists its parameters, return value and errors."""

    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        for name, member in list(cls.members.items()):
            doc = member.docstring
            if member.is_alias or not member.is_attribute or doc is None:
                continue
            first, _, rest = doc.value.partition("\n\n")
            m = _SIGNATURE.match(" ".join(first.split()))
            if not m or m["name"] != name:
                continue
            returns = f" -> {m['returns']}" if m["returns"] else ""
            code = f"def {name}(self, {m['params']}){returns}:\n    pass\n"
            module = griffe.visit(f"_{name}_signature", filepath=cls.filepath, code=code)
            func = module.members[name]
            func.docstring = griffe.Docstring(markdown(rest.strip("\n")), parent=func,
                                              parser=doc.parser, parser_options=doc.parser_options)
            func.lineno, func.endlineno = member.lineno, member.endlineno
            func.labels.add("method")
            del cls.members[name]
            cls.set_member(name, func)
