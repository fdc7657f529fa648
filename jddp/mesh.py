"""The data mesh (1-D, or two-level: hosts x local devices), and placing values on it: a global
batch split over the data axes (:func:`shard_batch`, the one way to place a batch yourself), a
tree held whole on every device (:func:`replicate_tree`)."""

from typing import Any

from jddp._src.api import deprecated as _deprecated
from jddp._src.runtime.mesh import (
    HOSTS_AXIS,
    LOCAL_AXIS,
    DataAxes,
    batch_sharding,
    data_axes,
    data_mesh,
    host_of_device,
    replicate_tree,
    replicated,
    shard_batch,
)
from jddp._src.step.checks import batch_size, check_batch

__all__ = [
    "HOSTS_AXIS",
    "LOCAL_AXIS",
    "DataAxes",
    "batch_sharding",
    "batch_size",
    "check_batch",
    "data_axes",
    "data_mesh",
    "host_of_device",
    "replicate_tree",
    "replicated",
    "shard_batch",
]


def __getattr__(name: str) -> Any:
    """The deprecated ``replicate`` (now :func:`replicate_tree`), with a warning."""
    return _deprecated.moved(__name__, name)
