"""Generates docs/api.md, the API reference, from the docstrings of ``jddp.__all__``.

Usage::

    python docs/gen_api.py            # (re)writes docs/api.md
    python docs/gen_api.py --check    # exits 1 if docs/api.md is out of date

Public names are documented in ``__all__`` order; a public submodule (``jddp.nnx``) gets a section
of its own with its ``__all__``. The subpackages in ``SUBPACKAGES`` (the performance tooling,
``jddp.perf``) follow, one section per module (by name), each with its ``__all__``. Classes list
their constructor signature, public methods and properties. Google-style docstring sections become
bold headings (Args, Attributes and Raises entries as bullets, whatever their indentation), and
``::`` literal blocks become fenced code. The output is deterministic (no addresses, no dates), so a test
can regenerate it and compare.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pathlib
import pkgutil
import re
import sys
import types
import typing
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "api.md"
#: Subpackages documented after the package's own names: every public module of each.
SUBPACKAGES = ("jddp.perf",)
SECTIONS = {"Args", "Arguments", "Returns", "Raises", "Attributes", "Yields", "Example", "Examples",
            "Note", "Notes"}
# Sections whose entries (``name: text`` at the section's first indentation) become bullets; the
# others (Returns, Yields) are paragraphs.
LIST_SECTIONS = {"Args", "Arguments", "Raises", "Attributes"}
_ENTRY = re.compile(r"^[\w.*]+(\s*\([^)]*\))?:(\s|$)")
_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")


class _Text:
    """An annotation shown as written in the source (``inspect`` would quote string annotations)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _annotation(a: Any) -> Any:
    if a is inspect.Parameter.empty:
        return a
    if isinstance(a, typing.ForwardRef):
        return _Text(a.__forward_arg__)
    if isinstance(a, str):
        return _Text(a)
    return _Text(inspect.formatannotation(a))


def _signature(obj: Any) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = []
    for p in sig.parameters.values():
        p = p.replace(annotation=_annotation(p.annotation))
        if inspect.isclass(p.default) and p.default is not inspect.Parameter.empty:
            # A class as default (``wrt=nnx.Param``) by name, not as ``<class 'flax...'>``.
            p = p.replace(default=_Text(p.default.__qualname__))
        params.append(p)
    sig = sig.replace(parameters=params, return_annotation=_annotation(sig.return_annotation))
    return _ADDR.sub("", str(sig))


def _docstring_md(doc: str | None) -> str:
    """Google-style docstring -> markdown (section headings, bullet entries, fenced examples)."""
    if not doc:
        return "*(no docstring)*\n"
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    i = 0
    in_section = False
    section: str | None = None
    entry_indent: int | None = None  # indentation of the current section's entries (2 or 4)
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        head = stripped[:-1] if stripped.endswith(":") and not stripped.endswith("::") else None
        if head in SECTIONS and not line.startswith(" "):
            out += ["", f"**{head}:**", ""]
            in_section = head not in {"Example", "Examples", "Note", "Notes"}
            section, entry_indent = head, None
            i += 1
            continue
        if stripped.endswith("::"):
            # A literal block: the indented lines that follow.
            text = stripped[:-2].rstrip()
            if text:
                out.append(line[: len(line) - len(line.lstrip())] + text + ":")
            i += 1
            block: list[str] = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            while block and not block[0].strip():
                block.pop(0)
            indent = min((len(b) - len(b.lstrip()) for b in block if b.strip()), default=0)
            out += ["", "```python", *[b[indent:] for b in block], "```", ""]
            continue
        indent = len(line) - len(line.lstrip())
        if in_section and stripped and indent:
            if entry_indent is None:
                entry_indent = indent
            entry = indent <= entry_indent and section in LIST_SECTIONS and _ENTRY.match(stripped)
            out.append(f"- {stripped}" if entry else f"  {stripped}")
        else:
            if not line.startswith(" "):
                in_section = in_section and bool(stripped)
            out.append(line)
        i += 1
    text = "\n".join(out).strip() + "\n"
    return re.sub(r"\n{3,}", "\n\n", text)


def _members(cls: type) -> list[tuple[str, Any]]:
    """Public methods and properties defined by ``cls`` itself, in definition order."""
    found = []
    for name, member in cls.__dict__.items():
        if name.startswith("_"):
            continue
        if isinstance(member, property | staticmethod | classmethod) or inspect.isfunction(member):
            found.append((name, member))
    return found


def _render_class(qualname: str, cls: type) -> list[str]:
    out = [f"### `{qualname}`", "", "```python", f"class {qualname}{_signature(cls)}", "```", ""]
    out.append(_docstring_md(cls.__doc__))
    for name, member in _members(cls):
        if isinstance(member, property):
            out += [f"#### `{qualname}.{name}` *(property)*", "", _docstring_md(member.__doc__)]
            continue
        fn = member.__func__ if isinstance(member, staticmethod | classmethod) else member
        out += [f"#### `{qualname}.{name}{_signature(fn)}`", "", _docstring_md(fn.__doc__)]
    return out


def _render_function(qualname: str, fn: Any) -> list[str]:
    return [f"### `{qualname}`", "", "```python", f"def {qualname}{_signature(fn)}", "```", "",
            _docstring_md(fn.__doc__)]


def _render_object(qualname: str, obj: Any) -> list[str]:
    if inspect.isclass(obj):
        return _render_class(qualname, obj)
    if callable(obj):
        return _render_function(qualname, obj)
    return [f"### `{qualname}`", "", f"`{_ADDR.sub('', repr(obj))}`", ""]


def _first_paragraph(doc: str | None) -> str:
    return inspect.cleandoc(doc or "").split("\n\n")[0].replace("\n", " ")


def subpackage_modules(subpackage: str) -> list[types.ModuleType]:
    """The public modules of ``subpackage`` (names without a leading ``_``), sorted by name."""
    pkg = importlib.import_module(subpackage)
    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))
    return [importlib.import_module(f"{subpackage}.{n}") for n in names]


def render(package: str = "jddp", subpackages: tuple[str, ...] = SUBPACKAGES) -> str:
    """The markdown API reference of ``package`` (``package.__all__``, submodules included) and
    of every public module of ``subpackages``."""
    mod = importlib.import_module(package)
    names = list(mod.__all__)
    out = [
        f"# `{package}` API reference",
        "",
        "Generated from the docstrings by `docs/gen_api.py`; do not edit by hand "
        "(`python docs/gen_api.py` rewrites it, and a test checks that it is current).",
        "",
        _first_paragraph(mod.__doc__),
        "",
        "## Contents",
        "",
    ]
    modules = [n for n in names if isinstance(getattr(mod, n), types.ModuleType)]
    objects = [n for n in names if n not in modules]
    out += [f"- [`{package}.{n}`](#{package}{n.lower()})" for n in objects]
    for m in modules:
        sub = getattr(mod, m)
        out += [f"- `{package}.{m}`: " + ", ".join(f"`{s}`" for s in sub.__all__)]
    extra = [m for sp in subpackages for m in subpackage_modules(sp)]
    for sub in extra:
        out += [f"- `{sub.__name__}`: " + ", ".join(f"`{s}`" for s in sub.__all__)]
    out += ["", f"## `{package}`", ""]
    for n in objects:
        out += _render_object(f"{package}.{n}", getattr(mod, n))
    for m in modules:
        sub = getattr(mod, m)
        out += [f"## `{package}.{m}`", "", _docstring_md(sub.__doc__)]
        for n in sub.__all__:
            out += _render_object(f"{package}.{m}.{n}", getattr(sub, n))
    for sp in subpackages:
        out += [f"## `{sp}`", "", _docstring_md(importlib.import_module(sp).__doc__)]
        for sub in subpackage_modules(sp):
            out += [f"## `{sub.__name__}`", "", _docstring_md(sub.__doc__)]
            for n in sub.__all__:
                out += _render_object(f"{sub.__name__}.{n}", getattr(sub, n))
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate docs/api.md from jddp's docstrings.")
    parser.add_argument("--check", action="store_true", help="fail if docs/api.md is out of date")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print("docs/api.md is out of date: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
