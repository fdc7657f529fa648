"""Gradient reduction: reducers, buckets reduced inside the backward pass, collectives."""
