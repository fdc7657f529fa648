"""Read compiled XLA (HLO) text: the scheduled order of a computation and its collectives.

Example::

    compiled = jax.jit(step).lower(params_like, batch_like).compile()
    sched = read_schedule(compiled.as_text())
    print(sched)                       # one row per collective
    assert all(ar.dots_between for ar in sched.all_reduces[:-1])
    assert not any(c.in_loop for c in collectives(compiled.as_text(), "all-reduce"))
"""

from jddp._src.introspect.hlo import (
    COLLECTIVE_KINDS,
    GPU_NO_OVERLAP,
    Array,
    Collective,
    Instruction,
    Module,
    Schedule,
    ScheduledOp,
    UnknownReplicaGroupsWarning,
    bucket_of,
    bucket_scope,
    collectives,
    compiled_text,
    parse_arrays,
    parse_replica_groups,
    read_module,
    read_schedule,
)

__all__ = [
    "COLLECTIVE_KINDS",
    "GPU_NO_OVERLAP",
    "Array",
    "Collective",
    "Instruction",
    "Module",
    "Schedule",
    "ScheduledOp",
    "UnknownReplicaGroupsWarning",
    "bucket_of",
    "bucket_scope",
    "collectives",
    "compiled_text",
    "parse_arrays",
    "parse_replica_groups",
    "read_module",
    "read_schedule",
]
