"""Gradient buckets: the plan of which parameters are reduced together, and in what order."""

from jddp._src.plan.autocap import AutoCap, CapChoice
from jddp._src.plan.modelcap import CPU_ALLREDUCE_TABLE, ModelCap
from jddp._src.plan.planner import Bucket, BucketPlan, assign_buckets, make_plan, plan_buckets

__all__ = ["CPU_ALLREDUCE_TABLE", "AutoCap", "Bucket", "BucketPlan", "CapChoice", "ModelCap",
           "assign_buckets", "make_plan", "plan_buckets"]
