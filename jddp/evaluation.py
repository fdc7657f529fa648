"""Data-parallel evaluation over a data set of any size: every real example counted once."""

from jddp._src.data.evaluation import Evaluator

__all__ = ["Evaluator"]
