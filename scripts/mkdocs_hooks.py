"""mkdocs hooks for the docs site (mkdocs.yml names this file under ``hooks:``).

- A code fence ```` ```python notest ```` marks a block that tests/test_doc_blocks.py does not run
  (its first line, ``# notest: why``, says why). Python-Markdown's fences take one word of
  language only, so the marker and that first line (a note for the tests, not for readers) are
  dropped before the page is rendered, and the block still renders as Python.
- The pages link to files outside docs/ the way GitHub shows them (``../examples/x.py``,
  ``../benchmarks/out/x.png``): those files are added to the site at the same place relative to
  the pages, so one link works on GitHub and on the site.
- Links into sections of README.md that moved to the docs point to where they went.
- The site's name carries the package's version (pyproject.toml), shown in the header; without
  a repository address (``JDDP_REPO_URL``, mkdocs.yml) the pages have no edit link.
- Code names never break inside a word: docs/css/extra.css must keep inline code from breaking
  anywhere (checked at every build), and inline code gets ``<wbr>`` break points after ``.``,
  ``,``, ``(``, ``/`` and ``|`` only. A stretch of inline code outside a table with no break
  point longer than ``MAX_UNBROKEN`` characters (it would overflow a 390 px column) fails the
  build; tables scroll inside themselves.
- On the API pages, inline code that is a bare ``jax.`` or ``optax.`` name links to its docs.
"""

from __future__ import annotations

import pathlib
import re
import tomllib
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parent.parent
_NOTEST = re.compile(r"^(?P<fence>(?P<indent> *)```+\s*python)\s+notest\s*\n"
                     r"(?:(?P=indent)#\s*notest:[^\n]*\n)?", re.MULTILINE)
#: Files outside docs/ that the pages link to, published with the site.
ASSETS = ("examples/*.py", "examples/out/*.png", "benchmarks/out/*.png")
_OUTSIDE = re.compile(r"\]\(\.\./((?:examples|benchmarks)/[^)\s]+)\)")
#: README.md sections that moved to the docs (old link -> new one, from a page in docs/).
MOVED = {
    "../README.md#input-pipeline-python-benchmarksloader_throughputpy---json-benchmarksout"
    "loader_throughputjson": "results.md#input-pipeline",
    "../README.md#checkpoint-saves-python-benchmarkscheckpoint_savepy---json-benchmarksout"
    "checkpoint_savejson": "results.md#checkpoint-saves",
    "../README.md#checkpoints": "checkpoints.md",
    "../README.md": "index.md",
}


#: The longest stretch of inline code without a break point, outside tables, that fits a
#: 390 px column (about 43 characters of 13.6 px monospace).
MAX_UNBROKEN = 42
#: CSS that lets a browser break a code name between two letters.
_MIDWORD_CSS = re.compile(r"overflow-wrap\s*:\s*anywhere|word-break\s*:\s*break-(all|word)")
#: The rule that undoes mkdocs-material's ``word-break: break-word`` on inline code.
_CODE_RULE = re.compile(r"\.md-typeset code\s*\{(?P<body>[^}]*)\}")
#: Inline code (code blocks start with a highlight span) holding text only.
_INLINE_CODE = re.compile(r"(?<!<pre>)(?<!</span>)<code>(?P<text>[^<]*)</code>")
_BREAK_AFTER = re.compile(r"(?:(?<=[.,(/|=])|(?<=--))(?=[^\s.,)=-])")
_TABLE = re.compile(r"<table>.*?</table>", re.S)


#: Inline code that is a bare JAX or optax name, linked to that library's docs (no inventory
#: is fetched at build time: JAX's pages are named after the object, optax's are searched).
_EXTERNAL = re.compile(r"<code>(?P<name>(?P<lib>jax|optax)(?:\.\w+)+)</code>")
_JAX_MODULES = ("jax.distributed", "jax.profiler", "jax.random", "jax.lax", "jax.numpy",
                "jax.sharding", "jax.tree", "jax.stages")
_DOCS = {"jax": "https://docs.jax.dev/en/latest/_autosummary/{}.html",
         "optax": "https://optax.readthedocs.io/en/latest/search.html?q={}"}


def external_links(html: str) -> str:
    """``html`` with each inline ``jax.x`` / ``optax.x`` name linked to its library's docs."""
    def link(m: re.Match[str]) -> str:
        name = m["name"]
        if name in _JAX_MODULES:
            url = f"https://docs.jax.dev/en/latest/{name}.html"
        elif m["lib"] == "jax" and name.rsplit(".", 1)[0] not in ("jax", *_JAX_MODULES):
            return m.group(0)  # a submodule JAX has no page for by this name: left as code
        else:
            url = _DOCS[m["lib"]].format(name)
        return f'<a href="{url}"><code>{name}</code></a>'
    return _EXTERNAL.sub(link, html)


def css_problems(css: str) -> list[str]:
    """Why ``css`` (docs/css/extra.css) lets a code name break inside a word, if it does."""
    problems = [f"{m.group(0)!r} breaks names between letters" for m in _MIDWORD_CSS.finditer(css)]
    rule = _CODE_RULE.search(css)
    body = rule.group("body") if rule else ""
    if not (re.search(r"word-break\s*:\s*normal", body)
            and re.search(r"overflow-wrap\s*:\s*normal", body)):
        problems.append("no '.md-typeset code { word-break: normal; overflow-wrap: normal }' "
                        "rule (mkdocs-material's code breaks anywhere)")
    return problems


def version() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def on_config(config: Any, **kwargs: Any) -> Any:
    """The version in the header; the CSS that keeps code names whole."""
    problems = css_problems((ROOT / "docs" / "css" / "extra.css").read_text())
    if problems:
        raise PluginError("docs/css/extra.css: " + "; ".join(problems))
    config["site_name"] = f"jddp {version()}"
    if not config.get("repo_url"):  # no repository address (JDDP_REPO_URL): no edit links
        config["edit_uri"] = None
    return config


def break_points(html: str) -> str:
    """``html`` with ``<wbr>`` after the punctuation of each inline code span: where a long name
    may wrap (``jddp.`` / ``local_sgd.`` / ``diloco``), never between two letters."""
    return _INLINE_CODE.sub(lambda m: "<code>" + _BREAK_AFTER.sub("<wbr>", m["text"]) + "</code>",
                            html)


def unbreakable(html: str) -> list[str]:
    """Inline code outside tables (before :func:`break_points`) with a stretch longer than
    ``MAX_UNBROKEN`` characters and no break point: it would overflow a phone's column."""
    found = []
    for m in _INLINE_CODE.finditer(_TABLE.sub("", html)):
        text = m["text"].replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
        text = text.replace("&quot;", '"')
        parts = _BREAK_AFTER.sub(" ", text).split()
        if any(len(part) > MAX_UNBROKEN for part in parts):
            found.append(text)
    return found


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    """Break points in inline code; a name too long for a phone's column fails the build."""
    long = unbreakable(html)
    if long:
        raise PluginError(f"{page.file.src_uri}: inline code with more than {MAX_UNBROKEN} "
                          "characters and no break point (a space, or after '.', ',', '(', "
                          f"'/', '|', '=', '--'): {long}")
    if page.file.src_uri.startswith("api/"):
        html = external_links(html)
    return break_points(html)


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    """Adds ``ASSETS`` to the site, each at its path relative to the repository root."""
    for pattern in ASSETS:
        for path in sorted(ROOT.glob(pattern)):
            rel = path.relative_to(ROOT).as_posix()
            if files.get_file_from_path(rel) is None:
                files.append(File(rel, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def _link(match: re.Match[str]) -> str:
    return f"]({match.group(1)})"


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Plain Python fences for ``notest`` blocks; links outside docs/ as the site has them."""
    markdown = _NOTEST.sub(lambda m: m["fence"] + "\n", markdown)
    depth = page.file.src_uri.count("/")
    if depth == 0:  # the pages in docs/ itself (docs/api/ links to nothing outside)
        markdown = _OUTSIDE.sub(_link, markdown)
        for old, new in MOVED.items():
            markdown = markdown.replace(f"]({old})", f"]({new})")
    return markdown
