"""Consistent replicas: the same start on every process, and a check that replicas stayed equal."""

from jddp._src.verify import (
    Divergence,
    LeafDesc,
    ReplicaDivergenceError,
    check_same_structure,
    describe,
    fingerprint,
    sync_from_process0,
    verify_replicas,
)

__all__ = [
    "Divergence",
    "LeafDesc",
    "ReplicaDivergenceError",
    "check_same_structure",
    "describe",
    "fingerprint",
    "sync_from_process0",
    "verify_replicas",
]
