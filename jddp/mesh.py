"""The data mesh, and placing parameters (replicated) and batches (sharded) on it."""

from jddp._src.checks import batch_size, check_batch
from jddp._src.mesh import batch_sharding, data_mesh, replicate, replicated, shard_batch

__all__ = [
    "batch_sharding",
    "batch_size",
    "check_batch",
    "data_mesh",
    "replicate",
    "replicated",
    "shard_batch",
]
