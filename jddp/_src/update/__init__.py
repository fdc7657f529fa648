"""The update wrappers around the optimizer: accumulation, skip guards, loss scaling."""
