"""Bytes a compiled step moves inside hosts and across them, read from its collectives.

For each collective of a compiled program (:func:`jddp.perf.schedule.collectives`) and each of its
replica groups, a ring over the group's devices in the listed order is assumed (what Gloo runs on
CPU; NCCL and TPU ICI pick other algorithms, whose byte counts are close to a ring's): every
device sends its share to the next device of the ring, and a hop *crosses* when the two devices
sit on different hosts (an all-to-all is not a ring: each device sends ``b/g`` straight to each
other member, and each pair is counted). Per device and collective, in bytes of the operands:

================  =================================  =======================================
kind              each device sends                  e.g. for ``b`` bytes over ``g`` devices
================  =================================  =======================================
all-reduce        ``2 (g-1)/g x b``                  reduce-scatter + all-gather phases
reduce-scatter    ``(g-1)/g x b`` (``b``: the input)
all-gather        ``(g-1) x b`` (``b``: one shard)
all-to-all        ``(g-1)/g x b``
================  =================================  =======================================

The totals are given **per host**: the bytes one host's devices send to other hosts (over the
slow link) and to each other (over the fast one). On 2 processes x 4 devices over Gloo this model
matched the bytes measured on the processes' sockets (``benchmarks/hierarchical.py``).

    mesh = jddp.data_mesh(hosts="process")
    text = ddp.lower(params, batch).compile().as_text()
    print(traffic(text, jddp.mesh.host_of_device(mesh)).table())
"""

from jddp._src.plan.traffic import (
    CollectiveTraffic,
    Traffic,
    sent_per_device,
    traffic,
)

__all__ = [
    "CollectiveTraffic",
    "Traffic",
    "sent_per_device",
    "traffic",
]
