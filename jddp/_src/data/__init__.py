"""Input: exactly-once loaders, uneven inputs, per-example randomness, evaluation."""
