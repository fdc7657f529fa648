"""Global batches from a random-access source: each process reads only its rows, every example
once per epoch, the order a function of ``(seed, epoch)`` only, resumable on any layout."""

from jddp._src.data.loader import ArraySource, HostBatch, Loader, WindowEnd, epoch_order

__all__ = ["ArraySource", "HostBatch", "Loader", "WindowEnd", "epoch_order"]
