"""Communication hooks: how one bucket of gradients is reduced (DDP's ``register_comm_hook``).

A hook is a pair of pure functions, like an optax ``GradientTransformation``: ``init(leaf_struct)
-> state`` and ``reduce(grads, states, ctx) -> (mean_grads, new_states)``; see :class:`CommHook`
and docs/hooks.md.
"""

from jddp._src.reduce.hooks import (
    CommHook,
    HookContext,
    allreduce_mean,
    bf16_compress,
    bucket_bytes_sent,
    fp16_compress,
    hierarchical,
    init_hook_state,
    int8_compress,
    plan_bytes_by_level,
    plan_bytes_sent,
    powersgd,
    ring_allgather_bytes,
    ring_allreduce_bytes,
    ring_bytes_by_level,
)

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
