"""Counts reads of the step's feature flags in ``jddp/_src`` (issue 36's "flag reads"), by AST.

Three counts:

- *StepConfig reads*: attribute accesses ``X.<name>`` where ``<name>`` is a field or property of
  ``StepConfig`` (as defined in that tree's ``jddp/_src/step/config.py``) and ``X`` is a config value
  (a name ``cfg``/``config``/``c``/``self._cfg``-style attribute ending in ``cfg`` or
  ``config``); ``config.py`` itself is counted separately. Once ``StepConfig`` holds policies,
  these are mostly calls of the policies' methods (``cfg.place.update``), not flags.
- *round-3 option reads* (the before-stop hook's rule): accesses of one of the 28 round-3
  option names on a name ``cfg``/``config``/``_cfg``/``self``, split into reads off a config and
  reads through ``self`` (a policy reading its own field, e.g. ``Accumulate.microbatches``).
- *branches in the skeleton*: ``if``/``else`` expressions and statements of
  ``jddp/_src/step/skeleton.py`` whose test reads an attribute of ``cfg`` (0: the step asks no
  policy which it is).

Also counts ``DataParallel``'s keywords.

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


ROUND3_OPTIONS = frozenset("""bucket_cap_mb first_bucket_mb has_aux bucket_plan chain
model_state_sync weighted keep_unused skip_not_finite accumulate_steps microbatches
accumulator_dtype shard_accumulator zero_stage hybrid_shard reshard_after_forward rng
sum_metrics loss_scale local_sgd deterministic group_size mixed_precision cap_bytes first_bytes
fixed_plan default_plan""".split())


def round3_reads(src: Path) -> dict[str, collections.Counter]:
    """Per module: Counter of ``"config"``/``"self"`` -> reads of a round-3 option name."""
    out: dict[str, collections.Counter] = {}
    for path in sorted(src.rglob("*.py")):
        counter: collections.Counter = collections.Counter()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ROUND3_OPTIONS:
                base = node.value
                name = base.id if isinstance(base, ast.Name) else (
                    base.attr if isinstance(base, ast.Attribute) else None)
                if name in ("cfg", "config", "_cfg"):
                    counter["config"] += 1
                elif name == "self":
                    counter["self"] += 1
        if counter:
            out[path.name] = counter
    return out


def skeleton_branches(skeleton_py: Path) -> list[int]:
    """Lines of the skeleton's ``if`` tests (statements and expressions) that read ``cfg``."""
    if not skeleton_py.exists():
        return []
    lines = []
    for node in ast.walk(ast.parse(skeleton_py.read_text())):
        if isinstance(node, ast.If | ast.IfExp):
            names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            if "cfg" in names:
                lines.append(node.lineno)
    return sorted(lines)


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
    r3 = round3_reads(src)
    off_config = sum(c["config"] for c in r3.values())
    through_self = sum(c["self"] for c in r3.values())
    print(f"round-3 option reads (the before-stop hook's rule): {off_config + through_self} = "
          f"{off_config} off a config + {through_self} through self (a policy's own field)")
    for module, c in sorted(r3.items(), key=lambda kv: -sum(kv[1].values())):
        print(f"  {module:24s} {c['config']:4d} off a config, {c['self']:4d} through self")
    branches = skeleton_branches(src / "skeleton.py")
    print(f"branches on cfg in skeleton.py: {len(branches)} {branches if branches else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "keywords": keywords, "total": total,
            "modules": {m: dict(c) for m, c in outside.items()},
            "round3": {m: dict(c) for m, c in r3.items()},
            "skeleton_branches": branches}, indent=1))


if __name__ == "__main__":
    main()
