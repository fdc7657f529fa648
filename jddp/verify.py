"""Consistent replicas: the same start on every process, and a check that replicas stayed equal.

``ProgramMismatchError`` is raised on every process of a job whose processes compiled different
step programs (checked before the first run of each).
"""

from jddp._src.runtime.verify import (
    Divergence,
    LeafDesc,
    ReplicaDivergenceError,
    check_same_structure,
    describe,
    fingerprint,
    sync_from_process0,
    verify_replicas,
)
from jddp._src.step.programs import ProgramMismatchError

__all__ = [
    "Divergence",
    "LeafDesc",
    "ProgramMismatchError",
    "ReplicaDivergenceError",
    "check_same_structure",
    "describe",
    "fingerprint",
    "sync_from_process0",
    "verify_replicas",
]
