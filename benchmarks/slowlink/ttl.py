"""Time to a target loss over the shaped link: 2 namespaces x 4 devices (root only).

The slow-link harness of ``bench.py`` (two network namespaces joined by a veth pair shaped with
``tbf``, one JAX process of 4 simulated CPU devices per namespace, started by ``jddp-run --nnodes
2``) on a real learning task: a byte-level MLP language model (Bengio et al. 2003: the previous
``--context`` bytes, embedded and concatenated, through ``--depth`` ReLU layers of ``--width``,
a softmax over the 256 byte values), trained with Adam on the source files of Python's standard
library and evaluated on held-out files of it (every machine with Python has the data). Every
variant trains from the same initial parameters on the same batches (batch ``k`` of host ``r`` is
drawn from ``(seed, r, k)``), at the same learning rate.

Per rate, the variants run **interleaved in chunks** (``--chunk`` steps of one variant, then the
next, the order rotated every round and reversed at every other rate), so the machine's load falls
on every variant alike; a variant leaves the rotation when its held-out loss reaches ``--target``
(or after ``--max-steps``). Every step is bracketed by two barriers across the hosts, so it runs
alone and its bytes are counted exactly: each host's veth ``tx_bytes`` between the barrier before
it and the barrier after it (when every byte of the step has crossed), minus an empty window (the
barrier alone). The step's time is the step alone (the barriers and the evaluations are not
counted); every ``--eval-every`` steps the loss of the parameters the variant would deliver
(DiLoCo: its global parameters, ``ddp.global_params``) is evaluated on a fixed held-out set.

Reported per variant and rate: steps to the target, seconds to the target (the sum of the step
times up to it), mean step time, bytes on the wire per step (mean and the peak step, each host's
own end) against jddp's model (``metrics["comm_bytes_hosts"]`` x devices per host).

Usage (as root; ``--local`` runs the same loop in one process of 8 devices on 2 simulated hosts,
no link, no root: for picking a target)::

    python benchmarks/slowlink/ttl.py --rates 300mbit 1gbit --json benchmarks/out/slowlink_ttl.json
    python benchmarks/slowlink/ttl.py --local --variants flat diloco --max-steps 96
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

VARIANTS = ["flat", "hierarchical", "hierarchical+int8", "diloco", "streaming", "diloco+int8"]
MIB = 2**20


# ---------------------------------------------------------------------------------- the task


def corpus(held_out: float = 0.1) -> tuple:
    """(train, held-out) bytes of the standard library's top-level ``*.py`` files, as uint8
    arrays: the files in sorted order, the last ``held_out`` of them held out."""
    import numpy as np

    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    if len(files) < 20:
        raise RuntimeError(f"expected Python's standard library next to {os.__file__}")
    cut = int(len(files) * (1 - held_out))

    def read(names: list[str]):
        return np.frombuffer(b"".join(open(f, "rb").read() for f in names), np.uint8)

    return read(files[:cut]), read(files[cut:])


def examples(text, positions, context: int) -> dict:
    """The examples ending at ``positions``: the ``context`` bytes before each, and the byte."""
    import numpy as np

    idx = positions[:, None] + np.arange(-context, 0)[None, :]
    return {"x": text[idx].astype(np.int32), "y": text[positions].astype(np.int32)}


def host_batch(text, args, rank: int, step: int) -> dict:
    """Host ``rank``'s share of step ``step``'s global batch (the same for every variant)."""
    import numpy as np

    rng = np.random.default_rng((args.seed, rank, step))
    local = args.batch // args.hosts
    return examples(text, rng.integers(args.context, len(text), size=local), args.context)


def init_params(args) -> dict:
    """Host (NumPy) parameters: byte embeddings, ``depth`` ReLU layers (He init), the output."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    sizes = [args.context * args.embed] + [args.width] * args.depth
    params = {"embed": rng.normal(size=(256, args.embed)).astype(np.float32),
              "out": {"kernel": (rng.normal(size=(args.width, 256)) / np.sqrt(args.width))
                      .astype(np.float32), "bias": np.zeros((256,), np.float32)}}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        params[f"Dense_{i}"] = {"kernel": (rng.normal(size=(a, b)) * np.sqrt(2 / a))
                                .astype(np.float32), "bias": np.zeros((b,), np.float32)}
    return params


def loss_fn(params: dict, batch: dict):
    """Mean cross-entropy (nats per byte) of the next byte."""
    import jax
    import optax

    x = params["embed"][batch["x"]].reshape(batch["x"].shape[0], -1)
    for i in range(len(params) - 2):
        layer = params[f"Dense_{i}"]
        x = jax.nn.relu(x @ layer["kernel"] + layer["bias"])
    logits = x @ params["out"]["kernel"] + params["out"]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make(name: str, mesh, args):
    """The DataParallel of variant ``name`` (every one with Adam at ``--lr`` and the same
    buckets)."""
    import optax

    import jddp

    kw: dict = {"mesh": mesh}
    if name == "hierarchical":
        kw["hook"] = jddp.hooks.hierarchical()
    elif name == "hierarchical+int8":
        kw["hook"] = jddp.hooks.hierarchical(inner=jddp.hooks.int8_compress())
    elif name == "diloco":
        kw["sync"] = jddp.local_sgd.diloco(args.period)
    elif name == "streaming":
        kw["sync"] = jddp.local_sgd.diloco(args.period, fragments=args.fragments)
    elif name == "diloco+int8":
        kw["sync"] = jddp.local_sgd.diloco(
            args.period, compress=jddp.hooks.int8_compress(error_feedback=False))
    elif name != "flat":
        raise ValueError(f"unknown variant {name!r}")
    reduce = jddp.Buckets(cap_mb=args.bucket_cap_mb, hook=kw.pop("hook", None))
    return jddp.DataParallel(loss_fn, optax.adam(args.lr), reduce=reduce, **kw)


# ---------------------------------------------------------------------------------- the ranks


class _Link:
    """Barriers and the veth counter of this rank (no-ops in ``--local`` mode)."""

    def __init__(self, dev: str | None) -> None:
        self.dev, self.count, self.empty = dev, 0, 0.0

    def barrier(self) -> None:
        if self.dev is not None:
            import jddp.distributed

            self.count += 1
            jddp.distributed.barrier(f"ttl {self.count}")

    def tx(self) -> int:
        if self.dev is None:
            return 0
        with open(f"/sys/class/net/{self.dev}/statistics/tx_bytes") as f:
            return int(f.read())

    def calibrate(self, windows: int = 8) -> None:
        """The bytes of an empty window (a barrier alone), subtracted from every step's."""
        sent = []
        for _ in range(windows):
            self.barrier()
            b0 = self.tx()
            self.barrier()
            sent.append(self.tx() - b0)
        self.empty = float(sorted(sent)[len(sent) // 2])

    def shape(self, rate: str) -> None:
        if self.dev is not None:
            from benchmarks.slowlink.netns import shape_command

            subprocess.run(shape_command(self.dev, None if rate == "none" else rate),
                           capture_output=True, check=rate != "none")


def park(tree):
    """``tree``'s arrays as host copies, one per distinct shard of this process (a replicated
    array's 4 device copies kept once): between its chunks a variant's state waits here, so six
    variants fit in memory (on CPU the devices' memory is the host's)."""
    import jax
    import numpy as np

    def one(x):
        if not isinstance(x, jax.Array):
            return x
        pieces: dict = {}
        where = []
        for s in x.addressable_shards:
            key = repr(s.index)
            if key not in pieces:
                pieces[key] = np.asarray(s.data)
            where.append((s.device, key))
        return _Parked(x.shape, x.sharding, where, pieces)

    return jax.tree.map(one, tree)


class _Parked:
    """One parked array (see :func:`park`)."""

    def __init__(self, shape, sharding, where, pieces) -> None:
        self.shape, self.sharding, self.where, self.pieces = shape, sharding, where, pieces

    def restore(self):
        import jax

        return jax.make_array_from_single_device_arrays(
            self.shape, self.sharding, [jax.device_put(self.pieces[k], d) for d, k in self.where])


def unpark(tree):
    """The arrays :func:`park` put aside, back on their devices with their shardings."""
    import jax

    return jax.tree.map(lambda x: x.restore() if isinstance(x, _Parked) else x, tree,
                        is_leaf=lambda x: isinstance(x, _Parked))


class _Run:
    """One variant's training at one rate: its (parked) state, step counter and records."""

    def __init__(self, ddp, params) -> None:
        self.ddp, self.state, self.steps, self.done = ddp, park(ddp.init(params)), 0, False
        self.rec: dict = {"step_s": [], "wire": [], "model": [], "curve": []}


def _chunk(run: _Run, link: _Link, batches, evaluate, args, local_devices: int) -> None:
    """``--chunk`` steps of one variant, each alone between two barriers; evaluates every
    ``--eval-every`` steps and marks the run done at the target or at ``--max-steps``."""

    run.state = park(_steps(run, unpark(run.state), link, batches, evaluate, args,
                            local_devices))


def _steps(run: _Run, state, link: _Link, batches, evaluate, args, local_devices: int):
    """The chunk's steps from the unparked ``state``; returns the state after them."""
    import jax

    for _ in range(args.chunk):
        link.barrier()
        b0, t0 = link.tx(), time.perf_counter()
        state, m = run.ddp.step(state, batches(run.steps))
        jax.block_until_ready(m)
        run.rec["step_s"].append(time.perf_counter() - t0)
        link.barrier()  # every byte of the step has crossed
        run.rec["wire"].append(link.tx() - b0 - link.empty)
        run.rec["model"].append(float(m["comm_bytes_hosts"]) * local_devices)
        run.steps += 1
        if run.steps % args.eval_every == 0:
            loss = float(evaluate(run.ddp.global_params(state)))
            run.rec["curve"].append((run.steps, sum(run.rec["step_s"]), loss))
            if loss <= args.target:
                run.done = True
        if run.steps >= args.max_steps:
            run.done = True
        if run.done:
            break
    return state


def _train_rate(ddps: dict, params, link: _Link, batches, evaluate, args, order: list[str],
                local_devices: int) -> dict:
    """Every variant from the same start to the target, interleaved in chunks, rotated."""
    runs = {name: _Run(ddps[name], params) for name in order}
    rnd = 0
    while not all(r.done for r in runs.values()):
        for name in order[rnd % len(order):] + order[: rnd % len(order)]:
            if not runs[name].done:
                _chunk(runs[name], link, batches, evaluate, args, local_devices)
                print(f"  {name}: {runs[name].steps} steps, loss "
                      f"{runs[name].rec['curve'][-1][2] if runs[name].rec['curve'] else '-'}",
                      flush=True)
        rnd += 1
    return {name: r.rec for name, r in runs.items()}


def _setup(args: argparse.Namespace):
    """The mesh, this rank's link, the parameters, the batches and the evaluation."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jddp

    me, nproc = jax.process_index(), jax.process_count()
    mesh = jddp.data_mesh(hosts="process" if not args.local else args.hosts)
    link = _Link(None if args.local else args.devs[me])
    train, held = corpus()
    mine = range(args.hosts) if args.local else [me]  # the hosts this process feeds

    def batches(step: int):
        parts = [host_batch(train, args, r, step) for r in mine]
        return jddp.distributed.global_batch_from_local(
            {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, mesh)

    positions = np.random.default_rng(12345).integers(args.context, len(held), size=args.eval_size)
    held_out = {k: v[me::nproc] for k, v in examples(held, positions, args.context).items()}
    eval_batch = jddp.distributed.global_batch_from_local(held_out, mesh)
    eval_jit = jax.jit(loss_fn, out_shardings=NamedSharding(mesh, P()))
    return mesh, link, init_params(args), batches, lambda p: eval_jit(p, eval_batch)


def _worker(args: argparse.Namespace) -> dict:
    """One rank: compiles every variant, then trains each to the target at every rate."""
    import jax

    import jddp

    if not args.local:
        # A generous heartbeat: a machine with a load of 50 once starved both ranks past 60 s.
        jddp.initialize(timeout_s=120, heartbeat_timeout_s=600)
    mesh, link, params, batches, evaluate = _setup(args)
    ddps = {name: make(name, mesh, args) for name in args.variants}
    t0 = time.perf_counter()
    for ddp in ddps.values():  # compile every program (a period covers every fragment's)
        state = ddp.init(params)
        for k in range(args.period):
            state, m = ddp.step(state, batches(k))
            jax.block_until_ready(m)
        jax.block_until_ready(evaluate(ddp.global_params(state)))
        del state
    plan = next(iter(ddps.values())).plan(params, batches(0))
    out: dict = {"rank": jax.process_index(), "compile_s": time.perf_counter() - t0,
                 "plan_bytes": [int(b.nbytes) for b in plan.buckets], "results": {}, "load": {},
                 "param_bytes": int(sum(x.size * 4 for x in jax.tree.leaves(params)))}
    print(f"compiled in {out['compile_s']:.0f} s; buckets {out['plan_bytes']}", flush=True)
    for i, rate in enumerate(args.rates):
        link.shape(rate)
        link.barrier()
        link.calibrate()
        order = list(args.variants) if i % 2 == 0 else list(reversed(args.variants))
        load0, t0 = os.getloadavg(), time.perf_counter()
        print(f"rate {rate} (empty window {link.empty:.0f} B)", flush=True)
        out["results"][rate] = _train_rate(ddps, params, link, batches, evaluate, args, order,
                                           mesh.shape["local"])
        out["load"][rate] = {"start": load0, "end": os.getloadavg(),
                             "wall_s": time.perf_counter() - t0, "empty_window_b": link.empty}
        if args.partial:  # each rate's results as soon as it is done
            with open(f"{args.partial}.rank{out['rank']}", "w") as f:
                json.dump(out, f)
    return out


# -------------------------------------------------------------------------------- the driver


def run(args: argparse.Namespace, timeout_s: float = 3600.0) -> dict:
    """The two ranks over the link (``bench.launch``), merged."""
    from benchmarks.slowlink.bench import launch

    def argv(link) -> list[str]:
        return [os.path.abspath(__file__), "--worker", "--devs", *link.devices,
                *_pass_through(args)]

    return merge(launch(argv, timeout_s), args)


def _pass_through(args: argparse.Namespace) -> list[str]:
    out = ["--variants", *args.variants, "--rates", *args.rates]
    if args.partial:
        out += ["--partial", os.path.abspath(args.partial)]
    for key in ("target", "max_steps", "chunk", "eval_every", "eval_size", "batch", "lr", "seed",
                "bucket_cap_mb", "context", "embed", "width", "depth", "period", "fragments"):
        out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out


def _summary(recs: list[dict], target: float) -> dict:
    """One variant at one rate, from each rank's records (steps and losses are the same on
    both; a step's time is the slower rank's)."""
    import numpy as np

    step_s = np.max([r["step_s"] for r in recs], axis=0)
    wire = np.array([r["wire"] for r in recs])  # [host, step]
    model = np.array(recs[0]["model"])
    curve = recs[0]["curve"]
    hit = next((c for c in curve if c[2] <= target), None)
    n = len(step_s)
    return {
        "reached": hit is not None,
        "steps_to_target": hit[0] if hit else None,
        "seconds_to_target": float(np.sum(step_s[: hit[0]])) if hit else None,
        "steps_run": n, "final_loss": curve[-1][2] if curve else None,
        "step_s_mean": float(np.mean(step_s)), "step_s_median": float(np.median(step_s)),
        "wire_bytes_mean": float(np.mean(wire)),
        "wire_bytes_mean_by_host": [float(x) for x in wire.mean(axis=1)],
        "wire_bytes_peak": float(np.max(wire)),
        "wire_bytes_peak_by_host": [float(x) for x in wire.max(axis=1)],
        "model_bytes_mean": float(np.mean(model)), "model_bytes_peak": float(np.max(model)),
        "period_wire_bytes": [float(x) for x in wire.mean(axis=0)[: min(n, 8)]],
        "curve": [[int(s), float(sec), float(lo)] for s, sec, lo in curve],
        "step_s": [float(x) for x in step_s],
    }


def merge(results: list[dict], args: argparse.Namespace) -> dict:
    by_rank = sorted(results, key=lambda r: r["rank"])
    out: dict = {"args": {k: v for k, v in vars(args).items() if k not in ("devs", "worker")},
                 "param_bytes": by_rank[0]["param_bytes"], "plan_bytes": by_rank[0]["plan_bytes"],
                 "compile_s": by_rank[0]["compile_s"], "load": by_rank[0]["load"], "rates": {}}
    for rate in args.rates:
        out["rates"][rate] = {
            name: _summary([r["results"][rate][name] for r in by_rank], args.target)
            for name in by_rank[0]["results"][rate]}
    return out


def table(result: dict) -> str:
    """The time-to-target table of a :func:`merge` result, one block per rate."""
    a = result["args"]
    lines = [f"byte-level MLP LM ({result['param_bytes'] / MIB:.1f} MiB of float32 parameters), "
             f"batch {a['batch']}, Adam {a['lr']}, target held-out loss {a['target']} "
             f"(evaluated every {a['eval_every']} steps), chunks of {a['chunk']} interleaved"]
    for rate, rows in result["rates"].items():
        ld = result["load"][rate]
        lines += [f"\nrate {rate} (load {ld['start'][0]:.1f} -> {ld['end'][0]:.1f}, "
                  f"{ld['wall_s']:.0f} s)",
                  "| variant | steps to target | s to target | step s (mean) | "
                  "MiB/step/host on the wire: mean (model) | peak step (model) |",
                  "|---|---|---|---|---|---|"]
        for name, r in rows.items():
            steps = r["steps_to_target"] if r["reached"] else \
                f"not in {r['steps_run']} (loss {r['final_loss']:.3f})"
            sec = f"{r['seconds_to_target']:.1f}" if r["reached"] else "-"
            lines.append(
                f"| {name} | {steps} | {sec} | {r['step_s_mean']:.3f} | "
                f"{r['wire_bytes_mean'] / MIB:.2f} ({r['model_bytes_mean'] / MIB:.2f}) | "
                f"{r['wire_bytes_peak'] / MIB:.2f} ({r['model_bytes_peak'] / MIB:.2f}) |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--rates", nargs="+", default=["1gbit", "300mbit"])
    p.add_argument("--target", type=float, default=3.0, help="held-out loss (nats per byte)")
    p.add_argument("--max-steps", type=int, default=56, help="per variant and rate")
    p.add_argument("--chunk", type=int, default=8, help="steps of a variant per turn")
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval-size", type=int, default=512, help="held-out examples")
    p.add_argument("--batch", type=int, default=128, help="global batch (examples)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=5.0)
    p.add_argument("--context", type=int, default=16, help="bytes of context")
    p.add_argument("--embed", type=int, default=96, help="embedding width per byte")
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--depth", type=int, default=4, help="hidden ReLU layers")
    p.add_argument("--period", type=int, default=8, help="DiLoCo's H")
    p.add_argument("--fragments", type=int, default=4, help="streaming DiLoCo's F")
    p.add_argument("--local", action="store_true",
                   help="one process, 8 devices on 2 simulated hosts, no link (no root)")
    p.add_argument("--json", default=None)
    p.add_argument("--partial", default=None,
                   help="each rank writes its results to PARTIAL.rankR after every rate")
    p.add_argument("--merge-partial", default=None, metavar="PARTIAL",
                   help="no run: merge the PARTIAL.rankR files of a run that ended early")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--devs", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.hosts = 2
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)), flush=True)
        return
    if args.merge_partial:  # a run that ended early: the rates both ranks finished
        parts = []
        for rank in (0, 1):
            with open(f"{args.merge_partial}.rank{rank}") as f:
                parts.append(json.load(f))
        args.rates = [r for r in args.rates if all(r in p["results"] for p in parts)]
        result = merge(parts, args)
    elif args.local:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        result = merge([_worker(args)], args)
    else:
        from benchmarks.slowlink.netns import HarnessUnavailable

        try:
            result = run(args)
        except HarnessUnavailable as e:
            sys.exit(f"slowlink ttl: {e}")
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
