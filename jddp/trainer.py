"""The data-parallel trainer, its state, and the step's configuration."""

from jddp._src.config import StepConfig
from jddp._src.state import AccumState, TrainState
from jddp._src.step import Step
from jddp._src.trainer import DataParallel

__all__ = ["AccumState", "DataParallel", "Step", "StepConfig", "TrainState"]
