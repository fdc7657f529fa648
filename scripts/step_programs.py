"""Fingerprints of the lowered step programs of every equal cell of the combination matrix.

A refactoring tool: ``--write F`` records the StableHLO (hashed) of each cell's step programs
(every call of its case: accumulation windows, hook and local-SGD phases); ``--check F`` lowers
them again and lists the cells whose programs changed. Same fingerprints: the same programs, so
the same bits. Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set below).

    python scripts/step_programs.py --write /tmp/before.json
    python scripts/step_programs.py --check /tmp/before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fingerprints(only: str | None = None) -> dict[str, list[str]]:
    import jax

    import jddp
    from tests import test_matrix as tm

    out: dict[str, list[str]] = {}
    for cell in tm.CELLS:
        if cell.expect[0] != "equal" or cell.api != "functional":
            continue
        cid = tm.cell_id(cell)
        if only and only not in cid:
            continue
        case = tm.CASES[cell.expect[1]]
        mesh = tm.mesh_for(cell.topology)
        caps = {} if cell.extra.get("default_plan") else tm.CAPS
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ddp = jddp.DataParallel(case.loss, case.optimizer(), mesh=mesh,
                                    **tm._options(cell, caps))
            state = (ddp.init(case.params()) if case.model_state is None
                     else ddp.init(case.params(), case.model_state))
            hashes = []
            for i, call in enumerate(case.calls()):
                batch = jddp.shard_batch(call["batch"], mesh)
                mask = call.get("mask")
                if mask is not None:
                    mask = jddp.shard_batch(mask, mesh)
                kw = {"rng": call["rng"]} if "rng" in call else {}
                text = ddp.step.lower(state, batch, mask, step=i, **kw).as_text()
                hashes.append(hashlib.sha256(text.encode()).hexdigest()[:16])
        out[cid] = hashes
        jax.clear_caches()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write")
    g.add_argument("--check")
    ap.add_argument("--only", help="cells whose id contains this")
    args = ap.parse_args()
    now = fingerprints(args.only)
    if args.write:
        with open(args.write, "w") as f:
            json.dump(now, f, indent=1)
        print(f"{len(now)} cells written to {args.write}")
        return 0
    with open(args.check) as f:
        before = json.load(f)
    changed = [c for c in now if before.get(c) != now[c]]
    missing = [c for c in before if c not in now and not args.only]
    for c in changed:
        print("CHANGED", c, before.get(c), now[c])
    for c in missing:
        print("MISSING", c)
    print(f"{len(now)} cells checked, {len(changed)} changed, {len(missing)} missing")
    return 1 if changed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
