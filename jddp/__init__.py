"""jddp: distributed data-parallel training for JAX, built like PyTorch DDP.

What most training scripts use is here: the trainer and its policies, the mesh and the one way
to place a batch, start-up, the built-in communication hooks and the errors a step raises. The
rest lives in its module (``jddp.hooks``, ``jddp.buckets``, ``jddp.mesh``, ``jddp.verify``,
``jddp.trainer``, ``jddp.distributed``, ``jddp.checkpoint``, ``jddp.nnx``, ``jddp.local_sgd``,
``jddp.random``, ``jddp.precision``, ``jddp.evaluation``, ``jddp.data``, and the performance
tooling in ``jddp.perf``). Names that used to be here too still work for one release, with a
``DeprecationWarning`` naming their module (docs/migration.md).
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
from jddp._src.api import deprecated as _deprecated
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
from jddp._src.plan.planner import plan_buckets
from jddp._src.reduce.dropin import value_and_grad
from jddp._src.reduce.hooks.cast import bf16_compress, fp16_compress
from jddp._src.reduce.hooks.powersgd import powersgd
from jddp._src.runtime.mesh import data_mesh, shard_batch
from jddp._src.runtime.verify import ReplicaDivergenceError
from jddp._src.step.programs import ProgramMismatchError
from jddp._src.step.state import TrainState
from jddp._src.step.trainer import DataParallel
from jddp.distributed import (
    initialize,
    is_main_process,
    shard_global_batch,  # noqa: F401  (deprecated: warns when called)
)

__all__ = [
    "Accumulate",
    "Buckets",
    "DataParallel",
    "Deterministic",
    "EveryStep",
    "Loss",
    "ProgramMismatchError",
    "ReplicaDivergenceError",
    "Replicate",
    "SkipNotFinite",
    "TrainState",
    "ZeRO",
    "bf16_compress",
    "data_mesh",
    "fp16_compress",
    "initialize",
    "is_main_process",
    "plan_buckets",
    "powersgd",
    "shard_batch",
    "value_and_grad",
]


def __getattr__(name: str) -> Any:
    """``jddp.perf`` on first use: the tooling stays out of ``import jddp`` (its submodules
    import lazily too), yet ``jddp.perf.profile`` works without an import of its own. A name
    that moved to its module (``jddp.data.pad_batch`` is ``jddp.data.pad_batch``) warns and gives
    the same object."""
    if name == "perf":
        return importlib.import_module("jddp.perf")
    return _deprecated.moved(__name__, name)
