"""Cost-model predictions past one host: flat, hierarchical, hybrid, local SGD and DiLoCo on 8 to
256 hosts of 8 GPUs, over three kinds of link between hosts (no GPU needed, a few seconds)::

    python benchmarks/scaling_hosts.py --json benchmarks/out/scaling_hosts.json \\
        --png benchmarks/out/scaling_hosts.png

Everything here is a *prediction* of :func:`jddp.perf.costmodel.simulate_strategy` from the stated
assumptions (A100-class compute, NVSwitch inside a host); nothing is measured. Profiles come from
:mod:`jddp.perf.profiles`; DDP's 25 MB buckets throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jddp.perf import costmodel as cm  # noqa: E402
from jddp.perf import profiles as rp  # noqa: E402

HOSTS = (8, 16, 32, 64, 128, 256)
PER_HOST = 8
DEVICE_FLOPS = 50e12  # achieved, A100 with mixed precision
INTRA = cm.Link.gbyte(230, 5)  # NVSwitch bus bandwidth
# Achieved ring bandwidth (about 90% of the line rate) and per-hop latency between hosts.
LINKS = {
    "400 Gb/s (InfiniBand/RoCE)": cm.Link.gbit(360, 10),
    "25 Gb/s Ethernet": cm.Link.gbit(22, 30),
    "1 Gb/s (across sites)": cm.Link.gbit(0.9, 2000),
}
MODELS = {
    "ResNet-50 (32 img/GPU)": lambda: rp.resnet50_profile(32, DEVICE_FLOPS),
    "BERT-large (16 x 128 tok/GPU)": lambda: rp.bert_large_profile(16, DEVICE_FLOPS, 128),
}
STRATEGIES = [("flat", 1), ("hierarchical", 1), ("hybrid", 1), ("local_sgd", 16),
              ("diloco", 16), ("diloco", 128)]


def label(strategy: str, period: int) -> str:
    return f"{strategy} H={period}" if strategy in ("local_sgd", "diloco") else strategy


def run() -> dict:
    out: dict = {"assumptions": {"device_flops": DEVICE_FLOPS, "per_host": PER_HOST,
                                 "intra_GBps": INTRA.bandwidth / 1e9,
                                 "links": {k: {"GBps": v.bandwidth / 1e9,
                                               "latency_us": v.latency * 1e6}
                                           for k, v in LINKS.items()}},
                 "rows": []}
    for model, make in MODELS.items():
        profile = make()
        for link_name, link in LINKS.items():
            print(f"\n{model}, {link_name} between hosts of {PER_HOST} GPUs "
                  f"(compute {profile.compute_s * 1e3:.1f} ms/step, "
                  f"{profile.total_bytes / 2**20:.0f} MiB of gradients)")
            print("| strategy | " + " | ".join(f"{h} hosts" for h in HOSTS)
                  + " | MiB across/host/step |")
            print("|---|" + "---|" * (len(HOSTS) + 1))
            for strategy, period in STRATEGIES:
                effs, across = [], 0.0
                for hosts in HOSTS:
                    cluster = cm.ClusterSpec(hosts * PER_HOST, devices_per_node=PER_HOST,
                                             intra=INTRA, inter=link, device_flops=DEVICE_FLOPS)
                    est = cm.simulate_strategy(profile, cluster, strategy, period=period)
                    effs.append(est.efficiency)
                    across = est.across_bytes
                    out["rows"].append({
                        "model": model, "link": link_name, "strategy": strategy,
                        "period": period, "hosts": hosts, "step_s": est.step_s,
                        "sync_step_s": est.sync_step_s, "local_step_s": est.local_step_s,
                        "efficiency": est.efficiency, "across_bytes": est.across_bytes,
                    })
                print(f"| {label(strategy, period)} | "
                      + " | ".join(f"{e:.2f}" for e in effs)
                      + f" | {across / 2**20:.0f} |")
    return out


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(MODELS), len(LINKS), figsize=(15, 8), sharex=True, sharey=True)
    for i, model in enumerate(MODELS):
        for j, link in enumerate(LINKS):
            ax = axes[i][j]
            for strategy, period in STRATEGIES:
                rows = [r for r in out["rows"] if r["model"] == model and r["link"] == link
                        and r["strategy"] == strategy and r["period"] == period]
                ax.plot([r["hosts"] for r in rows], [r["efficiency"] for r in rows], marker="o",
                        label=label(strategy, period))
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.05)
            ax.set_title(f"{model}\n{link}", fontsize=9)
            if i == len(MODELS) - 1:
                ax.set_xlabel("hosts (8 GPUs each)")
            if j == 0:
                ax.set_ylabel("scaling efficiency (predicted)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Cost-model predictions, not measurements: compute / step time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    out = run()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if args.png:
        plot(out, args.png)


if __name__ == "__main__":
    main()
