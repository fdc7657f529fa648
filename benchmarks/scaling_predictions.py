"""Cost-model predictions for ResNet-50 and BERT-large on 8 to 256 GPUs (no GPU needed).

Run from the repository root (a few seconds)::

    python benchmarks/scaling_predictions.py --json benchmarks/out/scaling_predictions.json \\
        --png benchmarks/out/scaling_predictions.png

Everything here is a *prediction* of :mod:`jddp.perf.costmodel` from stated assumptions (the scenario
table printed first); nothing is measured. Profiles come from :mod:`jddp.perf.profiles`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jddp.perf import costmodel as cm  # noqa: E402
from jddp.perf import profiles as rp  # noqa: E402

DEVICES = (8, 16, 32, 64, 128, 256)
CAPS_MB = (1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, math.inf)
DEFAULT_CAP = 25.0

# Achieved (not peak) throughput of a whole training step, and link bandwidths as achieved by a
# ring (about 90% of the network line rate; NCCL bus bandwidth for NVLink/NVSwitch).
SCENARIOS = {
    "V100 fp32, NVLink 130 GB/s, 100 Gb/s net": dict(
        device_flops=10e12, intra=cm.Link.gbyte(130, 5), inter=cm.Link.gbit(90, 10)),
    "A100 AMP, NVSwitch 230 GB/s, 400 Gb/s net": dict(
        device_flops=50e12, intra=cm.Link.gbyte(230, 5), inter=cm.Link.gbit(360, 10)),
}
MODELS = {
    "ResNet-50 (32 img/GPU)": lambda flops: rp.resnet50_profile(32, flops),
    "BERT-large (16 x 128 tok/GPU)": lambda flops: rp.bert_large_profile(16, flops, 128),
}


def cluster(n: int, s: dict, hierarchical: bool = True) -> cm.ClusterSpec:
    return cm.ClusterSpec(n, devices_per_node=8, intra=s["intra"], inter=s["inter"],
                          hierarchical=hierarchical, device_flops=s["device_flops"])


def fmt_cap(c: float) -> str:
    return "all" if math.isinf(c) else f"{c:g}"


def run() -> dict:
    out: dict = {"assumptions": {}, "scaling": [], "cap_sweep": [], "flat_ring_256": []}
    print("Assumptions (predictions, not measurements):")
    for name, s in SCENARIOS.items():
        out["assumptions"][name] = {
            "device_flops": s["device_flops"], "intra_GBps": s["intra"].bandwidth / 1e9,
            "intra_latency_us": s["intra"].latency * 1e6,
            "inter_GBps": s["inter"].bandwidth / 1e9,
            "inter_latency_us": s["inter"].latency * 1e6}
        print(f"  {name}: {s['device_flops'] / 1e12:g} TFLOP/s achieved per GPU; intra-node ring "
              f"{s['intra'].bandwidth / 1e9:g} GB/s, {s['intra'].latency * 1e6:g} us/step; "
              f"inter-node {s['inter'].bandwidth / 1e9:g} GB/s per node, "
              f"{s['inter'].latency * 1e6:g} us/step; hierarchical all-reduce; 8 GPUs/node")
    for mname, make in MODELS.items():
        for sname, s in SCENARIOS.items():
            prof = make(s["device_flops"])
            print(f"\n== {mname} | {sname}: {prof.num_leaves} tensors, "
                  f"{prof.total_bytes / 2**20:.1f} MiB of fp32 gradients, compute "
                  f"{prof.compute_s * 1e3:.1f} ms/iteration")
            print(f"{'GPUs':>5} {'iter ms':>8} {'exposed':>8} {'comm':>7} {'hidden':>6} "
                  f"{'scaling':>7} {'no-ovl ms':>9} {'ovl gain':>8} {'best cap':>8} "
                  f"{'best ms':>8}   (cap {DEFAULT_CAP:g} MiB unless noted)")
            for n in DEVICES:
                c = cluster(n, s)
                on, off, gain = cm.overlap_speedup(prof, c, cap_mb=DEFAULT_CAP)
                adv = cm.advise_bucket_cap(prof, c, candidates_mb=CAPS_MB)
                best = dict(adv.predictions)[adv.cap_mb]
                row = {"model": mname, "scenario": sname, "devices": n,
                       "iteration_s": on.iteration_s, "compute_s": on.compute_s,
                       "exposed_comm_s": on.exposed_comm_s, "comm_s": on.comm_s,
                       "overlap_fraction": on.overlap_fraction,
                       "scaling_efficiency": cm.scaling_efficiency(on),
                       "no_overlap_s": off.iteration_s, "overlap_gain": gain,
                       "no_overlap_scaling_efficiency": cm.scaling_efficiency(off),
                       "best_cap_mb": adv.cap_mb, "best_iteration_s": best.iteration_s,
                       "per_cap_s": {fmt_cap(k): v.iteration_s for k, v in adv.predictions}}
                out["scaling"].append(row)
                print(f"{n:>5} {on.iteration_s * 1e3:>8.1f} {on.exposed_comm_s * 1e3:>8.1f} "
                      f"{on.comm_s * 1e3:>7.1f} {on.overlap_fraction:>6.0%} "
                      f"{row['scaling_efficiency']:>7.1%} {off.iteration_s * 1e3:>9.1f} "
                      f"{gain:>8.1%} {fmt_cap(adv.cap_mb):>8} {best.iteration_s * 1e3:>8.1f}")
            for n in (32, 256):
                c = cluster(n, s)
                preds = [(cap, cm.simulate_iteration(prof, c, cap_mb=cap))
                         for cap in CAPS_MB]
                out["cap_sweep"].append({
                    "model": mname, "scenario": sname, "devices": n,
                    "caps": [fmt_cap(k) for k, _ in preds],
                    "iteration_s": [p.iteration_s for _, p in preds],
                    "buckets": [p.num_buckets for _, p in preds]})
                print(f"  cap sweep @ {n:>3} GPUs (ms): " + "  ".join(
                    f"{fmt_cap(k)}:{p.iteration_s * 1e3:.1f}" for k, p in preds))
            flat = cm.simulate_iteration(prof, cluster(256, s, hierarchical=False),
                                         cap_mb=DEFAULT_CAP)
            hier = cm.simulate_iteration(prof, cluster(256, s), cap_mb=DEFAULT_CAP)
            out["flat_ring_256"].append({"model": mname, "scenario": sname,
                                         "flat_s": flat.iteration_s,
                                         "hierarchical_s": hier.iteration_s})
            print(f"  256 GPUs, one flat ring instead of hierarchical: "
                  f"{flat.iteration_s * 1e3:.1f} ms vs {hier.iteration_s * 1e3:.1f} ms")
    return out


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for mname in MODELS:
        for sname in SCENARIOS:
            rows = [r for r in out["scaling"] if r["model"] == mname and r["scenario"] == sname]
            label = f"{mname.split(' ')[0]}, {sname.split(',')[0]}"
            line, = axes[0].plot([r["devices"] for r in rows],
                                 [r["scaling_efficiency"] for r in rows], "o-", label=label)
            axes[0].plot([r["devices"] for r in rows],
                         [r["no_overlap_scaling_efficiency"] for r in rows], "x--",
                         color=line.get_color())
            for sw in out["cap_sweep"]:
                if sw["model"] == mname and sw["scenario"] == sname:
                    ax = axes[1] if sw["devices"] == 32 else axes[2]
                    ax.plot(range(len(sw["caps"])),
                            [t / min(sw["iteration_s"]) for t in sw["iteration_s"]], "o-",
                            label=label)
                    ax.set_xticks(range(len(sw["caps"])), sw["caps"])
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("GPUs")
    axes[0].set_ylabel("scaling efficiency (compute / iteration)")
    axes[0].set_title(f"predicted weak scaling, cap {DEFAULT_CAP:g} MiB\n(solid: overlap, "
                      "dashed: all-reduce after backward)")
    axes[0].legend(fontsize=7)
    for ax, n in ((axes[1], 32), (axes[2], 256)):
        ax.set_xlabel("bucket cap (MiB)")
        ax.set_ylabel("iteration / best")
        ax.set_title(f"predicted iteration vs bucket cap, {n} GPUs")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_timeline(path: str) -> None:
    """A Gantt chart of ResNet-50's buckets on 32 V100s, cap 25 MiB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = next(iter(SCENARIOS.values()))
    prof = rp.resnet50_profile(32, s["device_flops"])
    fig, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True)
    for ax, overlap in zip(axes, (True, False), strict=True):
        est = cm.simulate_iteration(prof, cluster(32, s), cap_mb=DEFAULT_CAP,
                                    overlap=overlap)
        ax.barh(1, est.forward_s * 1e3, color="tab:blue", label="forward")
        ax.barh(1, est.backward_s * 1e3, left=est.forward_s * 1e3, color="tab:orange",
                label="backward")
        if est.optimizer_s > 0:  # the reference profiles leave the optimizer out (0 s)
            ax.barh(1, est.optimizer_s * 1e3, left=(est.iteration_s - est.optimizer_s) * 1e3,
                    color="tab:gray", label="optimizer")
        for b in est.buckets:
            ax.barh(0, b.duration_s * 1e3, left=b.start_s * 1e3, color="tab:green",
                    edgecolor="k")
            ax.plot([b.ready_s * 1e3], [0.45], "kv", ms=4)
        ax.set_yticks([0, 1], ["all-reduce", "compute"])
        ax.set_title(f"ResNet-50, 32 V100 (predicted), cap {DEFAULT_CAP:g} MiB, "
                     f"{'overlap' if overlap else 'no overlap'}: {est.iteration_s * 1e3:.1f} ms "
                     "(triangles: bucket ready)", fontsize=9)
    axes[1].set_xlabel("ms")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the predictions here")
    parser.add_argument("--png", help="write the scaling/cap plot here (and *_timeline.png)")
    args = parser.parse_args(argv)
    out = run()
    for path in (args.json, args.png):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.png:
        plot(out, args.png)
        plot_timeline(args.png.replace(".png", "_timeline.png"))


if __name__ == "__main__":
    main()
