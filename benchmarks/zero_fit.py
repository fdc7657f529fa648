"""The largest MLP and Transformer width whose compiled step fits in 2 GiB per device, for ZeRO
stages 0-3, with and without ``reshard_after_forward`` and mixed precision (issue #25).

Compile only: the step is lowered from abstract inputs (``jax.ShapeDtypeStruct``, nothing is
allocated) on 8 simulated CPU devices (``--gpu``: also 8 compile-only H100s) with Adam, and its
peak per device is ``compiled.memory_analysis()``'s arguments + outputs - aliased + temporaries
(``ddp.report``'s definition; the state is donated, as ``DataParallel`` does by default).

For each model and variant the width is searched on a grid of ``--step`` (128): the peak grows
like ``a w^2 + b w + c``, so after two compiles the search guesses the boundary from the
quadratic through the three compiles nearest it (``a w^2 + c`` from two), clamped strictly
inside the bracket (three guesses at most, then plain bisection), and stops when the largest
fitting width and the smallest width that does not fit are one step apart, both compiled.
Every reported width is therefore measured, not extrapolated: ``width`` fits (its peak is in the
table), ``width + step`` does not.

Models (``depth`` and the batch are fixed; only the width moves):

* MLP: 4 tanh layers of width ``w`` with biases, mean squared error, global batch 64.
* Transformer: a decoder-only LM, 2 pre-norm blocks of model width ``w`` (heads of 128, MLP
  4w, no biases but LayerNorm's), vocabulary 4096, learned positions, untied embeddings,
  global batch 16 sequences of 128 tokens, cross entropy in float32.

Few layers keep the compiles short (each takes 5-40 s on the shared 2-core machine). Default
bucket caps (25 MiB); 2 GiB is ``--limit-gib``.

    python benchmarks/zero_fit.py --json benchmarks/out/zero_fit.json [--gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jddp  # noqa: E402

GIB = 2**30
MIB = 2**20
STAGES = [("stage 0", dict(place=jddp.Replicate())), ("stage 1", dict(place=jddp.ZeRO(stage=1))),
          ("stage 2", dict(place=jddp.ZeRO(stage=2))),
          ("stage 3, keep", dict(place=jddp.ZeRO(stage=3, reshard_after_forward=False))),
          ("stage 3, reshard", dict(place=jddp.ZeRO(stage=3, reshard_after_forward=True))),
          # Adam's moments in host memory between steps (issue #39): device memory only
          ("stage 3, reshard, offload", dict(place=jddp.ZeRO(stage=3, offload=True)))]
PRECISIONS = [("float32", None), ("bf16 params", "bf16")]


# ------------------------------------------------------------------------------------ models


def _s(*shape: int, dtype: object = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def mlp(width: int, depth: int = 4, batch: int = 64) -> tuple:
    """(params_like, loss_fn, batch_like) of the MLP."""
    params = {f"l{i}": {"w": _s(width, width), "b": _s(width)} for i in range(depth)}

    def loss_fn(p, b):
        h = b["x"]
        for i in range(depth):
            h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return jnp.mean((h.astype(jnp.float32) - b["y"]) ** 2)

    return params, loss_fn, {"x": _s(batch, width), "y": _s(batch, width)}


def _norm(x, scale, bias):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias).astype(x.dtype)


def transformer(width: int, depth: int = 2, batch: int = 16, seq: int = 128,
                vocab: int = 4096, head: int = 128) -> tuple:
    """(params_like, loss_fn, batch_like) of the decoder-only Transformer LM."""
    heads = width // head
    block = {"ln1": {"scale": _s(width), "bias": _s(width)}, "qkv": _s(width, 3 * width),
             "out": _s(width, width), "ln2": {"scale": _s(width), "bias": _s(width)},
             "up": _s(width, 4 * width), "down": _s(4 * width, width)}
    params = {"embed": _s(vocab, width), "pos": _s(seq, width),
              "blocks": [dict(block) for _ in range(depth)],
              "ln": {"scale": _s(width), "bias": _s(width)}, "unembed": _s(width, vocab)}
    causal = np.tril(np.ones((seq, seq), bool))

    def loss_fn(p, b):
        x = p["embed"][b["x"]] + p["pos"]
        n = x.shape[0]
        for blk in p["blocks"]:
            h = _norm(x, blk["ln1"]["scale"], blk["ln1"]["bias"])
            q, k, v = jnp.split((h @ blk["qkv"]).reshape(n, seq, 3 * heads, head), 3, axis=2)
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head)
            s = jnp.where(causal, s.astype(jnp.float32), -1e9)
            a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1).astype(v.dtype), v)
            x = x + a.reshape(n, seq, width) @ blk["out"]
            h = _norm(x, blk["ln2"]["scale"], blk["ln2"]["bias"])
            x = x + jax.nn.gelu(h @ blk["up"]) @ blk["down"]
        logits = _norm(x, p["ln"]["scale"], p["ln"]["bias"]) @ p["unembed"]
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), b["y"]).mean()

    tokens = _s(batch, seq, dtype=jnp.int32)
    return params, loss_fn, {"x": tokens, "y": tokens}


MODELS = {"MLP (4 layers)": mlp, "Transformer (2 blocks)": transformer}


# ------------------------------------------------------------------------------------ search


def peak_bytes(model, width: int, kw: dict, precision, mesh) -> int:
    """The compiled step's peak per device (bytes), from abstract inputs."""
    params, loss_fn, batch = model(width)
    mp = None if precision is None else jddp.precision.MixedPrecision(param_dtype=jnp.bfloat16)
    ddp = jddp.DataParallel(loss_fn, optax.adam(1e-3), mesh=mesh, precision=mp, **kw)
    state = ddp.abstract_state(params)
    lowered = ddp.step.lower(state, batch)
    if isinstance(kw["place"], jddp.ZeRO) and kw["place"].offload and mesh.devices.flat[0].platform != "cpu":
        # Compile-only devices drop the memory kind: mark the optimizer state as host memory
        # (as JAX does on a real GPU); memory_analysis then counts it as host bytes.
        from jddp.perf import topologies

        marked = state.replace(opt_state=jax.tree.map(lambda _: "opt", state.opt_state))
        topologies.mark_host_arguments(lowered, [i for i, x in enumerate(jax.tree.leaves(marked))
                                                 if isinstance(x, str)])
    m = lowered.compile().memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.temp_size_in_bytes)


def _guess(points: dict[int, int], limit: int) -> float | None:
    """Where the quadratic through the three widths nearest the boundary reaches ``limit``
    (``a w^2 + c`` through two)."""
    if len(points) < 2:
        return None
    ws = sorted(points, key=lambda w: abs(points[w] - limit))[:3]
    if len(ws) == 2:
        a, c = np.polyfit([w * w for w in ws], [points[w] for w in ws], 1)
        return float(np.sqrt((limit - c) / a)) if a > 0 and limit > c else None
    a, b, c = np.polyfit(ws, [points[w] for w in ws], 2)
    roots = [r.real for r in np.roots([a, b, c - limit]) if abs(r.imag) < 1e-9 and r.real > 0]
    return max(roots) if roots else None


def largest_width(measure, limit: int, step: int, start: tuple[int, ...]) -> dict:
    """The largest multiple of ``step`` whose peak is at most ``limit``, and the compiles made.

    ``measure(width) -> bytes``, increasing in the width. Starts from ``start`` (two widths),
    widens the bracket by doubling, then narrows it (quadratic guess, else bisection).
    """
    points: dict[int, int] = {}

    def at(w: int) -> int:
        if w not in points:
            points[w] = measure(w)
        return points[w]

    for w in start:
        at(w)
    fits = [w for w in points if points[w] <= limit]
    over = [w for w in points if points[w] > limit]
    while not fits:
        w = max(step, (min(over) // 2) // step * step)
        if w in points:
            raise RuntimeError(f"even width {w} does not fit in {limit} bytes")
        at(w)
        fits, over = [w for w in points if points[w] <= limit], [w for w in points if points[w] > limit]
    while not over:
        guess = _guess(points, limit)
        w = max(fits) * 2 if guess is None else max(int(guess // step * step) + step,
                                                     max(fits) + step)
        at(w)
        fits, over = [w for w in points if points[w] <= limit], [w for w in points if points[w] > limit]
    lo, hi = max(fits), min(over)
    guesses = 3  # quadratic guesses before plain bisection (bounds the compiles either way)
    while hi - lo > step:
        guess = _guess(points, limit) if guesses else None
        if guess is None:
            w = (lo + hi) // 2 // step * step
        else:
            guesses -= 1
            w = int(min(max(guess // step * step, lo + step), hi - step))
        if at(w) <= limit:
            lo = w
        else:
            hi = w
    return dict(width=lo, peak_mib=points[lo] / MIB, next_width=hi, next_peak_mib=points[hi] / MIB,
                compiles=len(points), points={int(w): p / MIB for w, p in sorted(points.items())})


# -------------------------------------------------------------------------------------- main


def run(mesh, limit: int, step: int, models: list[str], log, variants: list[str]) -> dict:
    out: dict = {}
    for name in models:
        model = MODELS[name]
        out[name] = {}
        for pname, precision in PRECISIONS:
            for sname, kw in STAGES:
                if sname not in variants:
                    continue
                t0 = time.perf_counter()
                res = largest_width(lambda w, m=model, k=kw, p=precision: peak_bytes(m, w, k, p, mesh),
                                    limit, step, (1024, 2048))
                res["seconds"] = time.perf_counter() - t0
                out[name][f"{sname}, {pname}"] = res
                log(f"{name:24s} {sname:17s} {pname:11s} width {res['width']:6d} "
                    f"(peak {res['peak_mib']:7.1f} MiB; {res['next_width']} needs "
                    f"{res['next_peak_mib']:7.1f}) {res['compiles']} compiles {res['seconds']:.0f} s")
    return out


def table(results: dict, backend: str) -> str:
    rows = [f"Largest width under 2 GiB per device ({backend}, Adam): width "
            "(compiled peak MiB)", ""]
    for name, res in results.items():
        rows += [f"{name}:", "", "| stage | float32 | bf16 params |", "|---|---|---|"]
        for sname, _ in STAGES:
            if f"{sname}, {PRECISIONS[0][0]}" not in res:
                continue
            cells = [res[f"{sname}, {p}"] for p, _ in PRECISIONS]
            rows.append(f"| {sname} | " + " | ".join(
                f"{c['width']} ({c['peak_mib']:.0f})" for c in cells) + " |")
        rows.append("")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--gpu", action="store_true", help="also the compile-only 8xH100 target")
    p.add_argument("--limit-gib", type=float, default=2.0)
    p.add_argument("--step", type=int, default=128, help="width granularity (a multiple of 128)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    p.add_argument("--variants", default=";".join(s for s, _ in STAGES),
                   help="semicolon-separated rows (e.g. 'stage 3, reshard, offload')")
    p.add_argument("--no-cpu", action="store_true", help="only the H100 target (with --gpu)")
    args = p.parse_args()
    models = [m for m in MODELS if m in args.models.split(",")]
    variants = args.variants.split(";")
    limit = int(args.limit_gib * GIB)
    t0 = time.perf_counter()
    results = {"limit_bytes": limit, "step": args.step, "load_before": os.getloadavg()[0]}
    if not args.no_cpu:
        results["cpu"] = run(jddp.data_mesh(), limit, args.step, models, print, variants)
        print("\n" + table(results["cpu"], "8 simulated CPU devices"))
    if args.gpu:
        from jddp.perf import topologies

        results["h100"] = run(topologies.gpu_mesh(8), limit, args.step, models, print,
                              variants)
        print("\n" + table(results["h100"], "8 compile-only H100s"))
    results["seconds"] = time.perf_counter() - t0
    results["load_after"] = os.getloadavg()[0]
    print(f"\n{results['seconds']:.0f} s, load {results['load_before']:.1f} -> "
          f"{results['load_after']:.1f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
