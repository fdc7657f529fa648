"""The data-parallel trainer, its state, the step's configuration, and its report."""

from jddp._src.config import StepConfig
from jddp._src.report import CollectiveReport, MemoryReport, Report
from jddp._src.state import AccumState, TrainState
from jddp._src.step import Step
from jddp._src.trainer import DataParallel

__all__ = [
    "AccumState",
    "CollectiveReport",
    "DataParallel",
    "MemoryReport",
    "Report",
    "Step",
    "StepConfig",
    "TrainState",
]
