"""Counts reads of the step's feature flags in ``jddp/_src`` (issue 36's "flag reads"), by AST.

A read is an attribute access ``X.<name>`` where ``<name>`` is a field or property of
``StepConfig`` (as defined in that tree's ``jddp/_src/config.py``) and ``X`` is a config value:
a name ``cfg``/``config``/``c``/``self._cfg``-style attribute ending in ``cfg`` or ``config``.
Writes (``dataclasses.replace`` keywords, the dataclass's own field definitions) are not
reads; ``config.py`` itself is counted separately. Also counts ``DataParallel``'s keywords.

    python benchmarks/flag_reads.py [ROOT]          # ROOT: a checkout (default: this one)
    git worktree add /tmp/base f2b86e9 && python benchmarks/flag_reads.py /tmp/base
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
from pathlib import Path

CONFIG_NAMES = {"cfg", "config", "c", "_cfg", "_config"}


def step_config_names(config_py: Path, fields_only: bool = False) -> set[str]:
    """The fields and properties of the class ``StepConfig`` in ``config_py`` (or its fields
    only: the options, without the derived axis and count properties)."""
    tree = ast.parse(config_py.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "StepConfig":
            names = {n.target.id for n in node.body
                     if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            names |= set() if fields_only else {
                n.name for n in node.body if isinstance(n, ast.FunctionDef)
                      and any(isinstance(d, ast.Name) and d.id == "property"
                              for d in n.decorator_list)}
            return names - {"loss_fn", "optimizer", "mesh"}
    raise SystemExit(f"no StepConfig in {config_py}")


def _is_config(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in CONFIG_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in CONFIG_NAMES
    return False


def count_reads(src: Path, names: set[str]) -> dict[str, collections.Counter]:
    """Per module: a Counter of flag name -> reads."""
    out: dict[str, collections.Counter] = {}
    for path in sorted(src.glob("*.py")):
        counter: collections.Counter = collections.Counter()
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                    and node.attr in names and _is_config(node.value)):
                counter[node.attr] += 1
        if counter:
            out[path.name] = counter
    return out


def data_parallel_keywords(trainer_py: Path) -> list[str]:
    """The keyword-only parameters of ``DataParallel.__init__``."""
    for node in ast.walk(ast.parse(trainer_py.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "DataParallel":
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                    return [a.arg for a in f.args.kwonlyargs]
    raise SystemExit(f"no DataParallel.__init__ in {trainer_py}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).parent.parent))
    parser.add_argument("--fields-only", action="store_true",
                        help="count the option fields only, not the derived properties")
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args()
    src = Path(args.root) / "jddp" / "_src"
    names = step_config_names(src / "config.py", args.fields_only)
    reads = count_reads(src, names)
    outside = {m: c for m, c in reads.items() if m != "config.py"}
    total = sum(sum(c.values()) for c in outside.values())
    keywords = data_parallel_keywords(src / "trainer.py")
    what = "option fields" if args.fields_only else "option fields and properties"
    print(f"{args.root}: StepConfig has {len(names)} {what} (loss_fn, optimizer, mesh aside)")
    print(f"DataParallel keywords: {len(keywords)} ({', '.join(keywords)})")
    print(f"flag reads outside config.py: {total} in {len(outside)} modules")
    for module, c in sorted(outside.items(), key=lambda kv: -sum(kv[1].values())):
        print(f"  {module:24s} {sum(c.values()):4d} reads, {len(c):3d} flags")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "keywords": keywords, "total": total,
            "modules": {m: dict(c) for m, c in outside.items()}}, indent=1))


if __name__ == "__main__":
    main()
