"""Generates docs/api.md, the API reference, from the docstrings of ``jddp.__all__``.

Usage::

    python docs/gen_api.py            # (re)writes docs/api.md
    python docs/gen_api.py --check    # exits 1 if docs/api.md is out of date

The names of ``jddp.__all__`` are documented first, in order. Every public module of the package
(``jddp.hooks``, ``jddp.mesh``, ...: the top-level modules whose names do not start with ``_``)
follows with its ``__all__``; a name it shares with ``jddp`` links to that entry instead of being
repeated. The subpackages in ``SUBPACKAGES`` (the performance tooling, ``jddp.perf``) follow, one
section per module (by name), each with its ``__all__``. ``python docs/gen_api.py`` also rewrites
the module map of docs/design.md (:func:`module_map`). Classes list
their constructor signature, public methods and properties. Google-style docstring sections become
bold headings (Args, Attributes and Raises entries as bullets, whatever their indentation), and
``::`` literal blocks become fenced code. The output is deterministic (no addresses, no dates), so a test
can regenerate it and compare.
"""

from __future__ import annotations

import argparse
import ast
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
DESIGN = ROOT / "docs" / "design.md"
MAP_START, MAP_END = "<!-- module-map:start -->", "<!-- module-map:end -->"
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


def _anchor(package: str, name: str) -> str:
    return f"{package}{name}".lower()


def public_modules(package: str = "jddp") -> list[types.ModuleType]:
    """The package's public top-level modules (not subpackages, no leading ``_``), by name."""
    pkg = importlib.import_module(package)
    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)
                   if not m.name.startswith("_") and not m.ispkg)
    return [importlib.import_module(f"{package}.{n}") for n in names]


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
    objects = [n for n in names if not isinstance(getattr(mod, n), types.ModuleType)]
    out += [f"- [`{package}.{n}`](#{_anchor(package, n)})" for n in objects]
    modules = public_modules(package)
    extra = [m for sp in subpackages for m in subpackage_modules(sp)]
    for sub in modules + extra:
        out += [f"- `{sub.__name__}`: " + ", ".join(f"`{s}`" for s in sub.__all__)]
    out += ["", f"## `{package}`", ""]
    top = {id(getattr(mod, n)): n for n in objects}
    for n in objects:
        out += _render_object(f"{package}.{n}", getattr(mod, n))
    for sub in modules:
        out += [f"## `{sub.__name__}`", "", _docstring_md(sub.__doc__)]
        for n in sub.__all__:
            obj = getattr(sub, n)
            if id(obj) in top:
                name = top[id(obj)]
                out += [f"- `{sub.__name__}.{n}`: see [`{package}.{name}`]"
                        f"(#{_anchor(package, name)})"]
            else:
                out += [""] + _render_object(f"{sub.__name__}.{n}", obj)
        out.append("")
    for sp in subpackages:
        out += [f"## `{sp}`", "", _docstring_md(importlib.import_module(sp).__doc__)]
        for sub in subpackage_modules(sp):
            out += [f"## `{sub.__name__}`", "", _docstring_md(sub.__doc__)]
            for n in sub.__all__:
                out += _render_object(f"{sub.__name__}.{n}", getattr(sub, n))
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: pathlib.Path, package: str) -> list[str]:
    """The package modules a module imports at module level (from its source, not by importing)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if _is_module(sub) else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == package)
    return sorted(found)


def module_map(package: str = "jddp") -> str:
    """The markdown table of every module of the package: what it is (its docstring's first
    paragraph) and which of the package's modules it imports. docs/design.md embeds it."""
    root = ROOT / package
    rows = ["| module | what | imports |", "| --- | --- | --- |"]
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).parts):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        what = inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ").replace("|", "\\|")
        deps = ", ".join(f"`{d.removeprefix(package + '.')}`" for d in _imports(path, package)
                         if d != name)
        rows.append(f"| `{name}` | {what} | {deps} |")
    return "\n".join(rows) + "\n"


def render_design(current: str) -> str:
    """docs/design.md with its module map regenerated between the markers."""
    start, end = current.index(MAP_START) + len(MAP_START), current.index(MAP_END)
    return current[:start] + "\n" + module_map() + current[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Generate docs/api.md and the module map of docs/design.md from the source."
    )
    parser.add_argument("--check", action="store_true", help="fail if either is out of date")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    outputs = {OUT: render(), DESIGN: render_design(DESIGN.read_text())}
    stale = [p for p, text in outputs.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is out of date: run python docs/gen_api.py",
                  file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(outputs[p])
    return 0


if __name__ == "__main__":
    sys.exit(main())
