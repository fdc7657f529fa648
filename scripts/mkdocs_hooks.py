"""mkdocs hooks for the docs site (mkdocs.yml names this file under ``hooks:``).

- A code fence ```` ```python notest ```` marks a block that tests/test_doc_blocks.py does not run
  (its first line says why). Python-Markdown's fences take one word of language only, so the
  marker is dropped before the page is rendered, and the block still renders as Python.
- The pages link to files outside docs/ the way GitHub shows them (``../examples/x.py``,
  ``../benchmarks/out/x.png``): those files are added to the site at the same place relative to
  the pages, so one link works on GitHub and on the site.
- Links into sections of README.md that moved to the docs point to where they went.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parent.parent
_NOTEST = re.compile(r"^(\s*```+\s*python)\s+notest\s*$", re.MULTILINE)
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
    markdown = _NOTEST.sub(r"\1", markdown)
    depth = page.file.src_uri.count("/")
    if depth == 0:  # the pages in docs/ itself (docs/api/ links to nothing outside)
        markdown = _OUTSIDE.sub(_link, markdown)
        for old, new in MOVED.items():
            markdown = markdown.replace(f"]({old})", f"]({new})")
    return markdown
