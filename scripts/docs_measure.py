"""Measure the built docs site in headless Chromium: code names broken mid-word, clipped code
blocks, tables wider than the text, pages wider than the window.

    python scripts/docs_measure.py site --widths 1280 390 [--pages index.html ...] [--shots DIR]

Each page is copied with a small script appended that measures the laid-out page and writes the
figures into the DOM; ``chromium --headless --dump-dom`` returns them. A break is *mid-word*
when the characters on either side of a line break inside an inline ``<code>`` are both word
characters (letters, digits, ``_``): ``init_process_`` / ``group``. A code block is *clipped*
when it hides at least 5 characters (its scroll width exceeds its width). Needs ``chromium``
(Debian: ``apt-get install chromium``); not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

MEASURE_JS = r"""
<script>
window.addEventListener('load', () => setTimeout(() => {
  const W = /[A-Za-z0-9_]/, range = document.createRange(), out = {
    midword: 0, midword_in_tables: 0, examples: [], code_blocks: 0, clipped: 0,
    clipped_any: 0, tables: 0, wide_tables: 0, page_overflow: 0, code_overflow: 0};
  const content = document.querySelector('.md-content__inner') || document.body;
  const right = content.getBoundingClientRect().right;
  for (const el of content.querySelectorAll('code')) {
    if (el.closest('pre') || !el.offsetParent) continue;
    if (el.getBoundingClientRect().right > right + 10 && !el.closest('.md-typeset__table'))
    {
      out.code_overflow++;
      if (out.examples.length < 8) out.examples.push('overflow: ' + el.textContent.slice(0, 160));
    }
    const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    let prev = null, node, text = el.textContent;
    while ((node = walker.nextNode())) {
      for (let i = 0; i < node.data.length; i++) {
        range.setStart(node, i); range.setEnd(node, i + 1);
        const rects = range.getClientRects();
        if (!rects.length) continue;
        const ch = node.data[i], top = rects[0].top;
        if (prev && top > prev.top + 2 && W.test(prev.ch) && W.test(ch)) {
          out.midword++;
          if (el.closest('table')) out.midword_in_tables++;
          if (out.examples.length < 5) out.examples.push(text);
        }
        prev = {ch, top};
      }
    }
  }
  for (const el of content.querySelectorAll('pre > code')) {
    if (!el.offsetParent) continue;
    out.code_blocks++;
    const fs = parseFloat(getComputedStyle(el).fontSize), hidden = el.scrollWidth - el.clientWidth;
    if (hidden > 1) out.clipped_any++;
    if (hidden >= 5 * 0.6 * fs) out.clipped++;
  }
  for (const el of content.querySelectorAll('table')) {
    out.tables++;
    if (el.getBoundingClientRect().width > content.clientWidth + 1) out.wide_tables++;
  }
  out.page_overflow = document.documentElement.scrollWidth > window.innerWidth + 1 ? 1 : 0;
  const pre = document.createElement('pre');
  pre.id = 'jddp-measure'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}, 300));
</script>
"""

_RESULT = re.compile(r'<pre id="jddp-measure">(.*?)</pre>', re.S)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return name
    sys.exit("no chromium on PATH (Debian: apt-get install chromium)")


def _flags(width: int) -> list[str]:
    return [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--window-size={width},900", "--virtual-time-budget=4000"]


def measure(page: pathlib.Path, width: int) -> dict:
    html = page.read_text().replace("</body>", MEASURE_JS + "</body>")
    probe = page.with_name(f"{page.stem}.measure{width}.html")
    probe.write_text(html)
    try:
        dom = subprocess.run([*_flags(width), "--dump-dom", probe.as_uri()],
                             capture_output=True, text=True, timeout=120).stdout
    finally:
        probe.unlink()
    m = _RESULT.search(dom)
    return json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&")) if m else {}


def shot(page: pathlib.Path, width: int, path: pathlib.Path) -> None:
    subprocess.run([*_flags(width), f"--screenshot={path}", page.as_uri()],
                   capture_output=True, timeout=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("site", type=pathlib.Path)
    p.add_argument("--widths", type=int, nargs="+", default=[1280, 390])
    p.add_argument("--pages", nargs="*", help="pages relative to the site (default: all)")
    p.add_argument("--shots", type=pathlib.Path, help="save screenshots of --pages here")
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        site = pathlib.Path(tmp) / "site"
        shutil.copytree(args.site, site)
        pages = ([site / q for q in args.pages] if args.pages else
                 sorted(q for q in site.rglob("index.html") if q.parent.name != "assets"))
        pages = [q for q in pages if "404" not in q.as_posix()]
        jobs = [(q, w) for w in args.widths for q in pages]
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda j: measure(*j), jobs))
        if args.shots:
            args.shots.mkdir(parents=True, exist_ok=True)
            for q, w in jobs:
                rel = q.parent.relative_to(site).as_posix()
                name = "home" if rel == "." else rel.replace("/", "-")
                shot(q, w, args.shots / f"{name}-{w}.png")
    table: dict = {}
    for (q, w), r in zip(jobs, results, strict=True):
        table.setdefault(str(w), {})[q.relative_to(site).as_posix()] = r
    for w, rows in table.items():
        keys = ("midword", "midword_in_tables", "code_blocks", "clipped", "clipped_any",
                "tables", "wide_tables", "page_overflow", "code_overflow")
        tot = {k: sum(r.get(k, 0) for r in rows.values()) for k in keys}
        pages_with = sum(1 for r in rows.values() if r.get("midword"))
        failed = sum(1 for r in rows.values() if not r)
        print(f"{w} px: {len(rows)} pages ({failed} not measured); " +
              ", ".join(f"{k} {v}" for k, v in tot.items()) + f"; pages with mid-word {pages_with}")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
