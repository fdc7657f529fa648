"""jddp: distributed data-parallel training for JAX, built like PyTorch DDP."""

from jddp import distributed, nnx
from jddp.accumulate import AccumState, accum_dtype_for
from jddp.buckets import Bucket, BucketPlan, plan_buckets
from jddp.distributed import (
    global_batch_from_local,
    initialize,
    is_main_process,
    local_slice,
    shard_global_batch,
)
from jddp.hooks import (
    CommHook,
    HookContext,
    allreduce_mean,
    bf16_compress,
    fp16_compress,
    plan_bytes_sent,
    powersgd,
)
from jddp.mesh import batch_sharding, data_mesh, replicate, replicated, shard_batch
from jddp.reduce import bucketed_value_and_grad, init_hook_state, value_and_grad
from jddp.trainer import DataParallel, TrainState
from jddp.uneven import pad_batch
from jddp.unused import grad_reachable
from jddp.verify import (
    Divergence,
    ReplicaDivergenceError,
    check_same_structure,
    describe,
    sync_from_process0,
    verify_replicas,
)

__all__ = [
    "AccumState",
    "Bucket",
    "BucketPlan",
    "CommHook",
    "DataParallel",
    "Divergence",
    "HookContext",
    "ReplicaDivergenceError",
    "TrainState",
    "accum_dtype_for",
    "allreduce_mean",
    "batch_sharding",
    "bf16_compress",
    "bucketed_value_and_grad",
    "check_same_structure",
    "data_mesh",
    "describe",
    "distributed",
    "fp16_compress",
    "global_batch_from_local",
    "grad_reachable",
    "init_hook_state",
    "initialize",
    "is_main_process",
    "local_slice",
    "nnx",
    "pad_batch",
    "plan_buckets",
    "plan_bytes_sent",
    "powersgd",
    "replicate",
    "replicated",
    "shard_batch",
    "shard_global_batch",
    "sync_from_process0",
    "value_and_grad",
    "verify_replicas",
]
