"""jddp: distributed data-parallel training for JAX, built like PyTorch DDP.

What a training script uses is here; the rest is reachable from its module (``jddp.hooks``,
``jddp.buckets``, ``jddp.mesh``, ``jddp.verify``, ``jddp.trainer``, ``jddp.distributed``,
``jddp.checkpoint``, ``jddp.nnx``, ``jddp.local_sgd``, ``jddp.random``, ``jddp.precision``,
``jddp.evaluation``, ``jddp.data``, and the performance tooling in ``jddp.perf``).
"""

import importlib
from typing import Any

from jddp import (  # noqa: F401
    buckets,
    data,
    distributed,
    evaluation,
    hooks,
    local_sgd,
    mesh,
    nnx,
    precision,
    random,
    trainer,
    verify,
)
from jddp._src.api.policies import (
    Accumulate,
    Buckets,
    Deterministic,
    EveryStep,
    Loss,
    Replicate,
    SkipNotFinite,
    ZeRO,
)
from jddp._src.data.evaluation import Evaluator
from jddp._src.data.uneven import pad_batch
from jddp._src.plan.planner import BucketPlan, plan_buckets
from jddp._src.reduce.dropin import value_and_grad
from jddp._src.reduce.hooks import CommHook, HookContext
from jddp._src.reduce.hooks.cast import bf16_compress, fp16_compress
from jddp._src.reduce.hooks.powersgd import powersgd
from jddp._src.runtime.mesh import data_mesh, replicate, shard_batch
from jddp._src.runtime.verify import ReplicaDivergenceError, verify_replicas
from jddp._src.step.programs import ProgramMismatchError
from jddp._src.step.state import TrainState
from jddp._src.step.trainer import DataParallel
from jddp._src.update.loss_scale import DynamicScale
from jddp.distributed import (
    global_batch_from_local,
    initialize,
    is_main_process,
    shard_global_batch,
)

__all__ = [
    "Accumulate",
    "BucketPlan",
    "Buckets",
    "CommHook",
    "DataParallel",
    "Deterministic",
    "DynamicScale",
    "EveryStep",
    "Evaluator",
    "HookContext",
    "Loss",
    "ProgramMismatchError",
    "ReplicaDivergenceError",
    "Replicate",
    "SkipNotFinite",
    "TrainState",
    "ZeRO",
    "bf16_compress",
    "data",
    "data_mesh",
    "distributed",
    "fp16_compress",
    "global_batch_from_local",
    "hooks",
    "initialize",
    "is_main_process",
    "nnx",
    "pad_batch",
    "plan_buckets",
    "powersgd",
    "random",
    "replicate",
    "shard_batch",
    "shard_global_batch",
    "value_and_grad",
    "verify_replicas",
]


def __getattr__(name: str) -> Any:
    """``jddp.perf`` on first use: the tooling stays out of ``import jddp`` (its submodules
    import lazily too), yet ``jddp.perf.profile`` works without an import of its own."""
    if name == "perf":
        return importlib.import_module("jddp.perf")
    raise AttributeError(f"module 'jddp' has no attribute {name!r}")
