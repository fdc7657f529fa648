"""Read compiled XLA (HLO) text: the scheduled order of a computation and its collectives.

In three parts: the text's primitives (:mod:`.text`: arrays, replica groups, the canonical
text), its computations and instructions (:mod:`.module`), and the schedule and collectives
(:mod:`.schedule`).

jddp's only reader of HLO text. Public as :mod:`jddp.perf.schedule`, whose docstring describes
it in full (what is read, examples); it lives here because the step itself reads its compiled
program (the program check across processes, ``ddp.report``).
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
