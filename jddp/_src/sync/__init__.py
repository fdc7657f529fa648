"""Sync policies: how replicas stay in step (every step, local SGD, DiLoCo, islands)."""
