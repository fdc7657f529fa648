"""Read compiled XLA (HLO) text: the scheduled order of a computation and its collectives.

:mod:`.text` (primitives), :mod:`.module` (computations, instructions), :mod:`.schedule`. Public
as :mod:`jddp.perf.schedule`, described there; here because the step reads its own program.
"""

from jddp._src.introspect.hlo.module import (
    GPU_NO_OVERLAP,
    Instruction,
    Module,
    compiled_text,
    read_module,
    read_text,
)
from jddp._src.introspect.hlo.schedule import (
    Collective,
    Schedule,
    ScheduledOp,
    collectives,
    read_schedule,
)
from jddp._src.introspect.hlo.text import (
    COLLECTIVE_KINDS,
    Array,
    UnknownReplicaGroupsWarning,
    bucket_of,
    bucket_scope,
    canonical_text,
    known_groups,
    parse_arrays,
    parse_replica_groups,
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
    "canonical_text",
    "compiled_text",
    "known_groups",
    "parse_arrays",
    "parse_replica_groups",
    "read_module",
    "read_schedule",
    "read_text",
]
