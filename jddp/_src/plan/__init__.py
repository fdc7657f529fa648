"""Bucket plans and what they cost: the planner, cap choice, cost model, traffic, report."""
