"""``jddp.ZeRO(stage=s, offload=True)`` against ``offload=False``: memory, host<->device bytes,
the copies' overlap with compute, and the step time (issue #39).

Model: an MLP of 8 tanh layers of width ``--width`` (1024: 8.4M parameters, 32 MiB), global batch
64, Adam (two float32 moments per parameter), default bucket caps, stages 1-3.

* Memory per device, from ``compiled.memory_analysis()``: on 8 simulated CPU devices and on the
  compile-only 8 x H100 program (``--gpu``). "at rest" is the training state a device holds
  between steps (device memory, and host memory beside it); "peak" is ``arguments + outputs -
  aliased + temporaries`` (``ddp.report``'s definition), device and host figures apart. XLA:CPU
  keeps every memory kind in the same RAM, so there its figures do not move with offload.
  Compile-only devices have no memory spaces: the optimizer state's arguments are marked as
  pinned host memory in the lowered module (``jddp.perf.topologies.mark_host_arguments``), as
  JAX does on a real GPU.
* Bytes moved host<->device per step: the ``copy-start`` s whose source or destination is host
  memory (``S(5)``) in the H100 program, per device; and for each direction, how many copy pairs
  have compute (fusions, GEMMs, collectives) scheduled between start and done.
* Step time on the 8 CPU devices: ``offload`` off and on alternated, ``--rounds`` rounds of
  ``--steps`` steps each, the median per-step time of each (one run, same process).

    python benchmarks/offload.py --gpu --json benchmarks/out/offload.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jddp  # noqa: E402
from jddp._src.core.bytemodel import device_nbytes  # noqa: E402

MIB = 2**20
STAGES = (1, 2, 3)
LAYERS, BATCH = 8, 64


def model(width: int) -> tuple:
    """(params_like, loss_fn, batch_like) of the MLP."""
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    params = {f"l{i}": {"w": s(width, width), "b": s(width)} for i in range(LAYERS)}

    def loss_fn(p, b):
        h = b["x"]
        for i in range(LAYERS):
            h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return jnp.mean((h - b["y"]) ** 2)

    return params, loss_fn, {"x": s(BATCH, width), "y": s(BATCH, width)}


def trainer(mesh, width: int, stage: int, off: bool):
    params, loss_fn, batch = model(width)
    ddp = jddp.DataParallel(loss_fn, optax.adam(1e-3), mesh=mesh,
                            place=jddp.ZeRO(stage=stage, offload=off))
    return ddp, params, batch


def opt_state_indices(state) -> list[int]:
    marked = state.replace(opt_state=jax.tree.map(lambda _: "opt", state.opt_state))
    return [i for i, x in enumerate(jax.tree.leaves(marked)) if isinstance(x, str)]


def host_copies(text: str) -> dict:
    """Host<->device copies of a compiled GPU program: bytes per direction and how many pairs
    have compute scheduled between their start and done."""
    entry = text.split("\nENTRY")[1].split("\n}\n")[0].splitlines()[1:]
    starts: dict[str, tuple[int, str, int]] = {}
    out = {d: {"copies": 0, "bytes": 0, "overlapped": 0} for d in ("to_device", "to_host")}
    shape = re.compile(r"(\w+)\[([\d,]*)\]")
    itemsize = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}
    for i, line in enumerate(entry):
        m = re.match(r"\s*%(\S+) = \((\S+), (\S+), u32\[\]\) copy-start", line)
        if m:
            direction = "to_device" if ":S(5)" in m.group(3) else "to_host"
            dt, dims = shape.match(m.group(2)).groups()  # type: ignore[union-attr]
            size = int(np.prod([int(d) for d in dims.split(",") if d])) * itemsize.get(dt, 4)
            starts[m.group(1)] = (i, direction, size)
            continue
        m = re.match(r"\s*%\S+ = \S+ copy-done\(%(\S+)\)", line)
        if m and m.group(1) in starts:
            s, direction, size = starts[m.group(1)]
            between = [x for x in entry[s + 1:i]
                       if re.search(r" (fusion|custom-call|\S+-start)\(", x)
                       and not re.search(r" copy-(start|done)\(", x)]
            rec = out[direction]
            rec["copies"] += 1
            rec["bytes"] += size
            rec["overlapped"] += bool(between)
    return out


def memory(mesh, width: int, stage: int, off: bool, gpu: bool) -> dict:
    ddp, params, batch = trainer(mesh, width, stage, off)
    state = ddp.abstract_state(params)
    lowered = ddp.step.lower(state, batch)
    if off and gpu:
        from jddp.perf import topologies

        topologies.mark_host_arguments(lowered, opt_state_indices(state))
    compiled = lowered.compile()
    ma = compiled.memory_analysis()
    opt = device_nbytes(state.opt_state)
    total = device_nbytes(state)
    host = lambda f: int(getattr(ma, f"host_{f}_size_in_bytes"))
    rec = {
        "at_rest_device_mib": (total - (opt if off else 0)) / MIB,
        "at_rest_host_mib": (opt if off else 0) / MIB,
        "arguments_mib": ma.argument_size_in_bytes / MIB,
        "temporaries_mib": ma.temp_size_in_bytes / MIB,
        "peak_device_mib": (ma.argument_size_in_bytes + ma.output_size_in_bytes
                            - ma.alias_size_in_bytes + ma.temp_size_in_bytes) / MIB,
        "host_arguments_mib": host("argument") / MIB,
        "peak_host_mib": (host("argument") + host("output") - host("alias") + host("temp")) / MIB,
        "opt_state_mib": opt / MIB,
    }
    if gpu:
        rec["copies"] = host_copies(compiled.as_text())
    return rec


def step_times(width: int, rounds: int, steps: int) -> dict:
    """Median per-step seconds of each (stage, offload), alternated round by round."""
    mesh = jddp.data_mesh()
    rng = np.random.default_rng(0)
    runs = {}
    for stage in STAGES:
        for off in (False, True):
            ddp, params_like, batch_like = trainer(mesh, width, stage, off)
            params = jax.tree.map(lambda a: jnp.asarray(
                rng.standard_normal(a.shape) / np.sqrt(a.shape[0]), jnp.float32), params_like)
            batch = jddp.shard_batch(jax.tree.map(lambda a: np.asarray(
                rng.standard_normal(a.shape), np.float32), batch_like), mesh)
            state = ddp.init(params)
            state, _ = ddp.step(state, batch)  # compile
            runs[(stage, off)] = [ddp, state, batch, []]
    for _ in range(rounds):
        for run in runs.values():
            ddp, state, batch, times = run
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            for _ in range(steps):
                state, metrics = ddp.step(state, batch)
            jax.block_until_ready((state, metrics))
            times.append((time.perf_counter() - t0) / steps)
            run[1] = state
    return {f"stage {s}, offload={o}": {"median_ms": float(np.median(r[3]) * 1e3),
                                         "rounds_ms": [t * 1e3 for t in r[3]]}
            for (s, o), r in runs.items()}


def table(res: dict, backend: str) -> str:
    rows = [f"Per-device memory, {backend} (MiB): at rest device + host; peak device (host)", "",
            "| stage | offload | at rest device | at rest host | device arguments | "
            "peak device | peak host |", "|---|---|---|---|---|---|---|"]
    for key, r in res.items():
        rows.append(f"| {key.split(',')[0]} | {key.split('=')[1]} | {r['at_rest_device_mib']:.1f}"
                    f" | {r['at_rest_host_mib']:.1f} | {r['arguments_mib']:.1f} | "
                    f"{r['peak_device_mib']:.1f} | {r['peak_host_mib']:.1f} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--gpu", action="store_true", help="also the compile-only 8xH100 program")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    out: dict = {"width": args.width, "load_before": os.getloadavg()[0]}
    keys = [(s, o) for s in STAGES for o in (False, True)]
    out["cpu"] = {f"stage {s}, offload={o}": memory(jddp.data_mesh(), args.width, s, o, False)
                  for s, o in keys}
    print(table(out["cpu"], "8 simulated CPU devices"))
    if args.gpu:
        from jddp.perf import topologies

        mesh = topologies.gpu_mesh(8)
        out["h100"] = {f"stage {s}, offload={o}": memory(mesh, args.width, s, o, True)
                       for s, o in keys}
        print("\n" + table(out["h100"], "8 compile-only H100s"))
        print("\nHost<->device copies per step, per device (H100 program):")
        for key, r in out["h100"].items():
            if key.endswith("True"):
                c = r["copies"]
                print(f"  {key}: to device {c['to_device']['bytes'] / MIB:.2f} MiB in "
                      f"{c['to_device']['copies']} copies ({c['to_device']['overlapped']} with "
                      f"compute in flight); to host {c['to_host']['bytes'] / MIB:.2f} MiB in "
                      f"{c['to_host']['copies']} ({c['to_host']['overlapped']} overlapped)")
    out["step_time"] = step_times(args.width, args.rounds, args.steps)
    print(f"\nStep time, 8 CPU devices, alternated ({args.rounds} rounds x {args.steps} steps):")
    print("| stage | offload=False ms | offload=True ms | ratio |\n|---|---|---|---|")
    for s in STAGES:
        a = out["step_time"][f"stage {s}, offload=False"]["median_ms"]
        b = out["step_time"][f"stage {s}, offload=True"]["median_ms"]
        print(f"| {s} | {a:.2f} | {b:.2f} | {b / a:.3f} |")
    out["load_after"] = os.getloadavg()[0]
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
