"""The data-parallel trainer, its state, the step's configuration, and its report."""

from jddp._src.plan.report import CollectiveReport, MemoryReport, Report
from jddp._src.step.config import StepConfig
from jddp._src.step.state import AccumState, TrainState
from jddp._src.step.step import Step
from jddp._src.step.trainer import DataParallel

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
