"""jddp at two git revisions, alternated: peers.py's and step_overhead.py's ratios, first-step time.

Both revisions are the package ``jddp``, so they cannot share a process. Each revision is checked
out in its own detached worktree (``git worktree add --detach`` under a temporary directory,
removed at the end; committed trees only: uncommitted changes are not measured), and every
measurement runs in a fresh subprocess with ``PYTHONPATH`` at that worktree. Per round, for each
benchmark in turn, base and head run back to back in a new (seeded) order. Benchmarks:

- ``peers``: the revision's ``benchmarks/peers.py`` (default ``--models mlp --iters 3 --warmup 1
  --sweep= --no-auto``): each jddp variant's step time over the best peer's (ratio of medians)
  and the ``jddp default`` variant's first call (compile + step) and median step;
- ``overhead``: the revision's ``benchmarks/step_overhead.py`` (default ``--steps 200 --rounds 3
  --no-resnet``): jddp's wall and host (dispatch) time per step of the tiny MLP and both over
  pmap's (with ``--resnet`` in ``--overhead-args``, also the SyncBN ResNet's jddp/pmap);
- ``probe``: this file's ``--probe`` (one process per config): ``jddp.DataParallel(mlp_loss,
  optax.adam(1e-3), mesh=jddp.data_mesh(), **kw)`` on the benchmarks' 11.5M-parameter MLP, the
  first ``ddp.step`` call (trace + compile + run) and a warmed call, for the default config,
  ``zero_stage=3`` and ``accumulate_steps=2`` (keywords both f2b86e9 and the policy API accept;
  head's DeprecationWarning is silenced). For ``accum2`` the first window (2 calls: both programs
  compiled) is reported too.

Per metric: base and head medians over the rounds with min and max, head/base (ratio of the
medians) and the per-round head/base ratios' median and range. The load average at start and end
is printed and kept. Only the scripts of each revision run; if ``peers.py``, ``step_overhead.py``
or the model files differ between the revisions, a warning says so (the metric then measures the
scripts too).

    python benchmarks/versions.py --base f2b86e9 --head HEAD --rounds 3 \\
        --json benchmarks/out/versions.json
    python benchmarks/versions.py --rounds 1 --benches probe --probe-configs default  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

HERE = os.path.abspath(__file__)
BENCHES = ("peers", "overhead", "probe")
# Keywords both f2b86e9 and the policy API accept (head maps them to policies, with a warning).
PROBE_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "stage3": {"zero_stage": 3},
    "accum2": {"accumulate_steps": 2},
}
# Files whose difference between the revisions would change what a benchmark measures.
SCRIPTS = ("benchmarks/peers.py", "benchmarks/step_overhead.py", "benchmarks/_models.py",
           "benchmarks/_mlp.py")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="f2b86e9", help="git revision (default: round 3's release)")
    p.add_argument("--head", default="HEAD", help="git revision (committed tree)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seeds each round's base/head order")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--benches", default=",".join(BENCHES), help="subset of " + ",".join(BENCHES))
    p.add_argument("--peers-args", default="--models mlp --iters 3 --warmup 1 --sweep= --no-auto",
                   help="peers.py flags (write as --peers-args='...')")
    p.add_argument("--overhead-args", default="--steps 200 --rounds 3 --no-resnet",
                   help="step_overhead.py flags (write as --overhead-args='...')")
    p.add_argument("--probe-configs", default=",".join(PROBE_CONFIGS),
                   help="subset of " + ",".join(PROBE_CONFIGS))
    p.add_argument("--timeout", type=float, default=1200, help="seconds per subprocess")
    p.add_argument("--json", default=None)
    p.add_argument("--keep", default=None,
                   help="directory for every run's JSON and log (default: a temporary one)")
    # The probe (run by the driver in a subprocess, PYTHONPATH at a revision's worktree).
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default="default", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=1200, help="probe MLP width")
    p.add_argument("--depth", type=int, default=8, help="probe MLP layers")
    p.add_argument("--batch", type=int, default=256, help="probe global batch")
    p.add_argument("--warm-windows", type=int, default=3,
                   help="probe: warmed windows timed after the first (median per call)")
    return p.parse_args(argv)


# --- the probe: runs inside one revision -------------------------------------------------------

def probe(args: argparse.Namespace) -> dict[str, Any]:
    """Times the first ``ddp.step`` call (trace + compile + run) and warmed calls, one config."""
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jddp
    from benchmarks._mlp import mlp_loss, mlp_params

    kw = PROBE_CONFIGS[args.config]
    k = kw.get("accumulate_steps", 1)
    mesh = jddp.data_mesh()
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(args.batch, args.width)).astype(np.float32),
             "y": rng.normal(size=(args.batch, args.width)).astype(np.float32)}
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    t0 = time.perf_counter()
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-3), mesh=mesh, **kw)
    state = ddp.init(mlp_params(args.width, args.depth))
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    calls = []
    for _ in range(k * (1 + args.warm_windows)):
        t0 = time.perf_counter()
        state, metrics = ddp.step(state, batch)
        jax.block_until_ready((state, metrics))
        calls.append(time.perf_counter() - t0)
    return {"config": args.config, "keywords": kw, "jddp_file": jddp.__file__,
            "jax": jax.__version__, "init_s": init_s, "calls_s": calls, "first_s": calls[0],
            "first_window_s": sum(calls[:k]), "warm_s": statistics.median(calls[k:]),
            "programs": ddp.step.cache_size()}


# --- the driver ----------------------------------------------------------------------------------

def git(repo: str, *cmd: str) -> str:
    return subprocess.run(["git", "-C", repo, *cmd], check=True, capture_output=True,
                          text=True).stdout.strip()


@contextlib.contextmanager
def worktrees(repo: str, revs: dict[str, str]) -> Iterator[dict[str, str]]:
    """label -> path of a detached worktree at that commit, under a temporary directory; all are
    removed on exit (also on errors and Ctrl-C)."""
    tmp = tempfile.mkdtemp(prefix="jddp-versions-")
    paths: dict[str, str] = {}
    try:
        for label, sha in revs.items():
            path = os.path.join(tmp, label)
            git(repo, "worktree", "add", "--detach", path, sha)
            paths[label] = path
        yield paths
    finally:
        for path in paths.values():
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", path],
                           check=False, capture_output=True)
        git(repo, "worktree", "prune")
        shutil.rmtree(tmp, ignore_errors=True)


def child_env(tree: str) -> dict[str, str]:
    """The environment of a measurement: this revision's tree only, CPU, no compilation cache."""
    env = dict(os.environ, PYTHONPATH=tree, JAX_ENABLE_COMPILATION_CACHE="false")
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def run_json(cmd: list[str], tree: str, out: str, timeout: float) -> dict[str, Any]:
    """Runs ``cmd`` in ``tree``; returns the JSON it wrote to ``out`` (log next to it)."""
    with open(out + ".log", "w") as log:
        proc = subprocess.run(cmd, cwd=tree, env=child_env(tree), stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout, check=False)
    if proc.returncode != 0:
        with open(out + ".log") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}) in {tree}:\n{tail}")
    with open(out) as f:
        return json.load(f)


def peers_metrics(d: dict[str, Any]) -> dict[str, tuple[float, str]]:
    out = {}
    for key, r in d["models"].items():
        for name, ratio in r["ratio_to_best_peer"].items():
            if name.startswith("jddp"):
                out[f"peers {key}: {name} / best peer"] = (ratio, "x")
        if "jddp default" in r["median_s"]:
            out[f"peers {key}: jddp default step"] = (r["median_s"]["jddp default"] * 1e3, "ms")
            out[f"peers {key}: jddp default first call"] = (r["first_call_s"]["jddp default"],
                                                           "s")
    return out


def overhead_metrics(d: dict[str, Any]) -> dict[str, tuple[float, str]]:
    med = d["tiny"]["median"]
    j, p = med["jddp"], med["pmap"]
    out = {"overhead: jddp wall per step": (j["per_step_us"], "us"),
           "overhead: jddp host per step": (j["host_us"], "us"),
           "overhead: jddp / pmap wall": (j["per_step_us"] / p["per_step_us"], "x"),
           "overhead: jddp / pmap host": (j["host_us"] / p["host_us"], "x")}
    if "resnet" in d:
        m = d["resnet"]["median_s"]
        out["overhead: resnet jddp / pmap"] = (m["jddp"] / m["pmap"], "x")
    return out


def probe_metrics(d: dict[str, Any]) -> dict[str, tuple[float, str]]:
    c = d["config"]
    out = {f"probe {c}: first step": (d["first_s"], "s")}
    if d["first_window_s"] != d["first_s"]:
        out[f"probe {c}: first window"] = (d["first_window_s"], "s")
    out[f"probe {c}: warm step"] = (d["warm_s"] * 1e3, "ms")
    out[f"probe {c}: programs"] = (float(d["programs"]), "n")
    return out


def jobs(args: argparse.Namespace) -> list[tuple[str, str, Any]]:
    """``(bench, job name, argv builder)`` of one round: builder(tree, out) -> argv."""
    py = sys.executable
    dev = ["--devices", str(args.devices)]
    chosen = [b for b in args.benches.split(",") if b]
    unknown = set(chosen) - set(BENCHES)
    if unknown:
        raise SystemExit(f"unknown --benches {sorted(unknown)}; choose from {BENCHES}")
    out: list[tuple[str, str, Any]] = []
    if "peers" in chosen:
        extra = shlex.split(args.peers_args)
        out.append(("peers", "peers", lambda t, o: [py, os.path.join(t, "benchmarks/peers.py"),
                                                    *extra, *dev, "--json", o]))
    if "overhead" in chosen:
        extra2 = shlex.split(args.overhead_args)
        out.append(("overhead", "overhead",
                    lambda t, o: [py, os.path.join(t, "benchmarks/step_overhead.py"), *extra2,
                                  *dev, "--json", o]))
    if "probe" in chosen:
        sizes = ["--width", str(args.width), "--depth", str(args.depth), "--batch",
                 str(args.batch), "--warm-windows", str(args.warm_windows)]
        for c in args.probe_configs.split(","):
            if c not in PROBE_CONFIGS:
                raise SystemExit(f"unknown probe config {c!r}; choose from {list(PROBE_CONFIGS)}")
            out.append(("probe", f"probe-{c}",
                        lambda t, o, c=c: [py, HERE, "--probe", "--config", c, *sizes, *dev,
                                           "--json", o]))
    return out


EXTRACT = {"peers": peers_metrics, "overhead": overhead_metrics, "probe": probe_metrics}


def measure(args: argparse.Namespace, trees: dict[str, str], tmp: str) -> tuple[dict, list]:
    """Runs every job of every round, base and head back to back in a seeded order.

    Returns:
      ``(values, orders)``: values[metric][label][round] = (value, unit); orders[round] = the
      list of ``(job, label)`` in the order run.
    """
    rng = random.Random(args.seed)
    values: dict[str, dict[str, dict[int, tuple[float, str]]]] = {}
    orders = []
    todo = jobs(args)
    for r in range(args.rounds):
        order = []
        for bench, name, argv in todo:
            labels = list(trees)
            rng.shuffle(labels)
            for label in labels:
                out = os.path.join(tmp, f"{name}-{label}-{r}.json")
                t0 = time.perf_counter()
                d = run_json(argv(trees[label], out), trees[label], out, args.timeout)
                if bench == "probe" and not os.path.realpath(d["jddp_file"]).startswith(
                        os.path.realpath(trees[label]) + os.sep):
                    raise RuntimeError(f"the probe imported {d['jddp_file']}, not {label}'s tree")
                for metric, v in EXTRACT[bench](d).items():
                    values.setdefault(metric, {}).setdefault(label, {})[r] = v
                order.append((name, label))
                print(f"round {r + 1}/{args.rounds} {name:<16} {label:<4} "
                      f"{time.perf_counter() - t0:6.1f} s (load {os.getloadavg()[0]:.1f})",
                      file=sys.stderr, flush=True)
        orders.append(order)
    return values, orders


def spread(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def summarize(values: dict) -> dict[str, Any]:
    """Per metric: base and head medians/min/max, head/base and the per-round ratios."""
    out = {}
    for metric, by in values.items():
        if set(by) != {"base", "head"}:
            continue  # a metric only one revision reports (a variant one of them lacks)
        unit = next(iter(by["base"].values()))[1]
        rounds = sorted(set(by["base"]) & set(by["head"]))
        b = [by["base"][r][0] for r in rounds]
        h = [by["head"][r][0] for r in rounds]
        paired = [y / x for x, y in zip(b, h, strict=True) if x]
        out[metric] = {"unit": unit, "rounds": len(rounds), "base": spread(b), "head": spread(h),
                       "ratio": statistics.median(h) / statistics.median(b)
                       if statistics.median(b) else None,
                       "per_round_ratio": spread(paired) if paired else None}
    return out


def fmt(x: float, unit: str) -> str:
    if unit == "n":
        return f"{x:g}"
    if unit == "x":
        return f"{x:.3f}"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def table(summary: dict[str, Any]) -> str:
    rows = [f"{'metric':<46} {'unit':>4} {'base median (min-max)':>24} "
            f"{'head median (min-max)':>24} {'head/base':>9} {'per round (min-max)':>21}"]
    for metric, s in summary.items():
        u = s["unit"]
        cells = []
        for side in ("base", "head"):
            x = s[side]
            cells.append(f"{fmt(x['median'], u)} ({fmt(x['min'], u)}-{fmt(x['max'], u)})")
        pr = s["per_round_ratio"]
        per = "-" if pr is None else f"{pr['median']:.3f} ({pr['min']:.2f}-{pr['max']:.2f})"
        ratio = "-" if s["ratio"] is None else f"{s['ratio']:.3f}"
        rows.append(f"{metric:<46} {u:>4} {cells[0]:>24} {cells[1]:>24} {ratio:>9} {per:>21}")
    return "\n".join(rows)


def describe(repo: str, rev: str) -> dict[str, str]:
    sha = git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}")
    return {"rev": rev, "sha": sha, "subject": git(repo, "log", "-1", "--format=%s", sha)}


def changed_scripts(repo: str, base: str, head: str) -> list[str]:
    return [f for f in SCRIPTS
            if git(repo, "rev-parse", f"{base}:{f}") != git(repo, "rev-parse", f"{head}:{f}")]


def versions(args: argparse.Namespace) -> dict[str, Any]:
    """Measures both revisions, prints the table and writes ``--json``."""
    repo = git(os.path.dirname(HERE), "rev-parse", "--show-toplevel")
    revs = {"base": describe(repo, args.base), "head": describe(repo, args.head)}
    for label, r in revs.items():
        print(f"{label}: {r['rev']} = {r['sha'][:10]} {r['subject'][:80]}")
    differ = changed_scripts(repo, revs["base"]["sha"], revs["head"]["sha"])
    if differ:
        print(f"WARNING: these differ between base and head (measured too): {', '.join(differ)}")
    load0, t0 = os.getloadavg(), time.time()
    print(f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, "
          f"{os.cpu_count()} CPUs, {args.rounds} rounds, seed {args.seed}", flush=True)
    with worktrees(repo, {k: r["sha"] for k, r in revs.items()}) as trees:
        with contextlib.ExitStack() as stack:
            if args.keep:
                os.makedirs(args.keep, exist_ok=True)
                tmp = args.keep
            else:
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="jddp-versions-"))
            values, orders = measure(args, trees, tmp)
    load1 = os.getloadavg()
    summary = summarize(values)
    print(f"\nhead/base over {args.rounds} alternated rounds ({time.time() - t0:.0f} s; "
          f"load average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f})")
    print(table(summary))
    one_sided = sorted(set(values) - set(summary))
    if one_sided:
        print(f"reported by one revision only (not compared): {', '.join(one_sided)}")
    out = {"base": revs["base"], "head": revs["head"], "rounds": args.rounds, "seed": args.seed,
           "devices": args.devices, "benches": args.benches, "peers_args": args.peers_args,
           "overhead_args": args.overhead_args, "probe_configs": args.probe_configs,
           "probe_mlp": {"width": args.width, "depth": args.depth, "batch": args.batch},
           "scripts_differ": differ, "one_sided": one_sided, "order": orders, "python": platform.python_version(),
           "cpus": os.cpu_count(), "load_start": load0, "load_end": load1,
           "wall_s": time.time() - t0, "metrics": summary}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"\nwrote {args.json}")
    return out


def main() -> None:
    args = parse_args()
    if not args.probe:
        versions(args)
        return
    d = probe(args)
    print(json.dumps(d, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(d, f, indent=2)


if __name__ == "__main__":
    main()
