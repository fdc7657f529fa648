"""Global batches from a random-access source: each process reads only its rows, every example
once per epoch, the order a function of ``(seed, epoch)`` only, resumable on any layout; and
:func:`pad_batch` for a last batch that does not fill every device."""

from jddp._src.data.loader import ArraySource, HostBatch, Loader, WindowEnd, epoch_order
from jddp._src.data.uneven import pad_batch

__all__ = ["ArraySource", "HostBatch", "Loader", "WindowEnd", "epoch_order", "pad_batch"]
