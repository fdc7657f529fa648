"""The data mesh (1-D, or two-level: hosts x local devices), and placing parameters (replicated)
and batches (sharded) on it."""

from jddp._src.runtime.mesh import (
    HOSTS_AXIS,
    LOCAL_AXIS,
    DataAxes,
    batch_sharding,
    data_axes,
    data_mesh,
    host_of_device,
    replicate,
    replicated,
    shard_batch,
)
from jddp._src.step.checks import batch_size, check_batch

__all__ = [
    "HOSTS_AXIS",
    "LOCAL_AXIS",
    "DataAxes",
    "batch_sharding",
    "batch_size",
    "check_batch",
    "data_axes",
    "data_mesh",
    "host_of_device",
    "replicate",
    "replicated",
    "shard_batch",
]
