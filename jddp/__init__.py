"""jddp: distributed data-parallel training for JAX, built like PyTorch DDP."""

from jddp.buckets import Bucket, BucketPlan, plan_buckets
from jddp.costmodel import ClusterSpec, Link, ModelProfile, suggest_bucket_cap
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
    "init_hook_state",
    "plan_buckets",
    "replicate",
    "replicated",
    "shard_batch",
    "suggest_bucket_cap",
    "value_and_grad",
]
