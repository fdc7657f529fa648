"""jddp: distributed data-parallel training for JAX, built like PyTorch DDP."""

__all__: list[str] = []
