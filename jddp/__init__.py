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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jddp import (  # noqa: F401  (submodules, imported on first use)
        buckets,
        data,
        distributed,
        evaluation,
        hooks,
        local_sgd,
        mesh,
        nnx,
        perf,
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

# Every name is imported on first use (PEP 562), so that `import jddp` costs nothing by itself:
# `jddp-run`, which only starts and watches processes, imports this package but never JAX.
_SUBMODULES = frozenset({
    "buckets", "data", "distributed", "evaluation", "hooks", "local_sgd", "mesh", "nnx", "perf",
    "precision", "random", "trainer", "verify",
})
_HOMES = {
    "jddp._src.api.policies": ("Accumulate", "Buckets", "Deterministic", "EveryStep", "Loss",
                               "Replicate", "SkipNotFinite", "ZeRO"),
    "jddp._src.plan.planner": ("plan_buckets",),
    "jddp._src.reduce.dropin": ("value_and_grad",),
    "jddp._src.reduce.hooks.cast": ("bf16_compress", "fp16_compress"),
    "jddp._src.reduce.hooks.powersgd": ("powersgd",),
    "jddp._src.runtime.mesh": ("data_mesh", "shard_batch"),
    "jddp._src.runtime.verify": ("ReplicaDivergenceError",),
    "jddp._src.step.programs": ("ProgramMismatchError",),
    "jddp._src.step.state": ("TrainState",),
    "jddp._src.step.trainer": ("DataParallel",),
    "jddp.distributed": ("initialize", "is_main_process", "shard_global_batch"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    """A public name or submodule, imported on first use. ``jddp.perf`` and its submodules are
    reachable without an import of their own (``jddp.perf.profile``). A name that moved to its
    module warns, naming the module, and gives the same object."""
    if name in _SUBMODULES:
        return importlib.import_module(f"jddp.{name}")
    home = _HOME.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value
        return value
    from jddp._src.api import deprecated

    return deprecated.moved(__name__, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME) | _SUBMODULES)
