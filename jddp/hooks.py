"""Communication hooks: how one bucket of gradients is reduced (DDP's ``register_comm_hook``).

A hook is a pair of pure functions, like an optax ``GradientTransformation``: ``init(leaf_struct)
-> state`` and ``reduce(grads, states, ctx) -> (mean_grads, new_states)``; see :class:`CommHook`
and docs/hooks.md.
"""

from jddp._src.core.bytemodel import (
    ring_allgather_bytes,
    ring_allreduce_bytes,
    ring_bytes_by_level,
)
from jddp._src.reduce.bytemodel import (
    bucket_bytes_sent,
    plan_bytes_by_level,
    plan_bytes_sent,
)
from jddp._src.reduce.hooks import CommHook, HookContext, init_hook_state
from jddp._src.reduce.hooks.cast import bf16_compress, fp16_compress
from jddp._src.reduce.hooks.hierarchical import hierarchical
from jddp._src.reduce.hooks.int8 import int8_compress
from jddp._src.reduce.hooks.mean import allreduce_mean
from jddp._src.reduce.hooks.powersgd import powersgd

__all__ = [
    "CommHook",
    "HookContext",
    "allreduce_mean",
    "bf16_compress",
    "bucket_bytes_sent",
    "fp16_compress",
    "hierarchical",
    "init_hook_state",
    "int8_compress",
    "plan_bytes_by_level",
    "plan_bytes_sent",
    "powersgd",
    "ring_allgather_bytes",
    "ring_allreduce_bytes",
    "ring_bytes_by_level",
]
