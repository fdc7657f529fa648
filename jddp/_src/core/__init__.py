"""Shared primitives every policy family may use: the leaves' split over devices (ZeRO's
layout and its collectives), collectives that are right on every backend, and the
mixed-precision policy's dtypes. It imports no policy family."""
