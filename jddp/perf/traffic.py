"""Bytes a compiled step moves inside hosts and across them, read from its collectives.

A ring per replica group; totals per host, across hosts and inside them:

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
