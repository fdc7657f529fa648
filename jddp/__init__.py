"""jddp: distributed data-parallel training for JAX, built like PyTorch DDP."""

from jddp import distributed, nnx, xla_flags
from jddp.buckets import Bucket, BucketPlan, plan_buckets
from jddp.costmodel import ClusterSpec, Link, ModelProfile, suggest_bucket_cap
from jddp.distributed import (
    global_batch_from_local,
    initialize,
    is_main_process,
    local_slice,
    shard_global_batch,
)
from jddp.hooks import CommHook, HookContext, allreduce_mean
from jddp.mesh import batch_sharding, data_mesh, replicate, replicated, shard_batch
from jddp.reduce import bucketed_value_and_grad, init_hook_state, value_and_grad
from jddp.trainer import DataParallel, TrainState

__all__ = [
    "Bucket",
    "BucketPlan",
    "ClusterSpec",
    "CommHook",
    "DataParallel",
    "HookContext",
    "Link",
    "ModelProfile",
    "TrainState",
    "allreduce_mean",
    "batch_sharding",
    "bucketed_value_and_grad",
    "data_mesh",
    "distributed",
    "global_batch_from_local",
    "init_hook_state",
    "initialize",
    "is_main_process",
    "local_slice",
    "nnx",
    "plan_buckets",
    "replicate",
    "replicated",
    "shard_batch",
    "shard_global_batch",
    "suggest_bucket_cap",
    "value_and_grad",
    "xla_flags",
]
