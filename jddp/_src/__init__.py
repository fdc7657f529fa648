"""jddp's implementation. Nothing here is public API: import from ``jddp`` and its top-level modules."""
