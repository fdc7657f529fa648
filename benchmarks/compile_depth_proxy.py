"""Compiled step size per layer of each policy: the cheap proxy of benchmarks/compile_depth.py.

For each depth (LM of benchmarks/_models.py, width 32) and variant, the instructions of the
lowered and compiled step (``count_instructions``), and, for two depths, the per-layer difference
of the compiled program's opcode histogram (which operations a variant adds per layer).

Variants: ``jit`` (jit + NamedSharding), ``default``, ``zero2``, ``zero3``, ``zero3nr``
(``reshard_after_forward=False``), ``acc`` (``Accumulate(steps=2)``, ``sync=None``: one program
with a ``lax.cond``), ``acc_t`` / ``acc_f`` (the same with ``sync=True`` / ``sync=False``).

    python benchmarks/compile_depth_proxy.py 4,8 jit,default,zero3,acc,acc_t,acc_f
"""

from __future__ import annotations

import collections
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def opcodes(text):
    """Opcode histogram of the lines of an HLO text that define a value."""
    c: collections.Counter = collections.Counter()
    for line in text.splitlines():
        if " = " in line:
            m = re.search(r" ([a-z][a-z0-9\-\._]*)\(", line.split(" = ", 1)[1])
            c[m.group(1) if m else "?"] += 1
    return c


def lowered(variant, bm, mesh):
    """The lowered step of ``variant`` on model ``bm``."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jddp
    from benchmarks.compile_depth import _peer_step

    opt = optax.adam(1e-3)
    data = jax.device_put(bm.batch, NamedSharding(mesh, P("data")))
    if variant == "jit":
        rep = NamedSharding(mesh, P())
        step = jax.jit(_peer_step("jit+NamedSharding", bm, mesh, opt))
        return step.lower(jax.device_put(bm.params, rep),
                          jax.device_put(opt.init(bm.params), rep), data)
    acc = {"accumulate": jddp.Accumulate(steps=2)}
    policy = {"default": {}, "zero2": {"place": jddp.ZeRO(stage=2)},
              "zero3": {"place": jddp.ZeRO(stage=3)},
              "zero3nr": {"place": jddp.ZeRO(stage=3, reshard_after_forward=False)},
              "acc": acc, "acc_t": acc, "acc_f": acc}[variant]
    f = bm.loss("data")
    ddp = jddp.DataParallel(lambda p, b: f(p, None, b)[0], opt, mesh=mesh, **policy)
    sync = {"acc_t": {"sync": True}, "acc_f": {"sync": False}}.get(variant, {})
    return ddp.step.lower(ddp.init(bm.params), data, **sync)


def main():
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jddp
    from benchmarks.compile_depth import _model, count_instructions

    depths = [int(d) for d in sys.argv[1].split(",")]
    variants = sys.argv[2].split(",")
    mesh = jddp.data_mesh()
    res = {}
    for depth in depths:
        bm = _model(depth, 32)
        for v in variants:
            jax.clear_caches()
            lo = lowered(v, bm, mesh)
            text = lo.compile().as_text()
            res[v, depth] = (count_instructions(lo.as_text()), count_instructions(text),
                             opcodes(text))
            print(f"{v} {depth} layers: lowered {res[v, depth][0]} compiled {res[v, depth][1]}",
                  flush=True)
    if len(depths) == 2:
        a, b = depths
        for v in variants:
            (la, ca, oa), (lb, cb, ob) = res[v, a], res[v, b]
            delta = {k: (ob[k] - oa[k]) / (b - a) for k in set(oa) | set(ob)}
            top = sorted(((round(x, 1), k) for k, x in delta.items() if abs(x) >= 2), reverse=True)
            print(f"{v}: per layer lowered {(lb - la) / (b - a):.0f} compiled "
                  f"{(cb - ca) / (b - a):.0f}; opcodes {top}")


if __name__ == "__main__":
    main()
