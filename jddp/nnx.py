"""Flax NNX support: data-parallel training of an ``nnx.Module`` (see :class:`DataParallel`)."""

from jddp._src.step.nnx import DataParallel, wrap

__all__ = ["DataParallel", "wrap"]
