"""The training step: the skeleton of phases, its configuration, state and drivers."""
