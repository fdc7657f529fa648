"""Performance tooling for jddp: predicting, measuring and inspecting a data-parallel step."""

from __future__ import annotations

import importlib
from types import ModuleType

#: The submodules, imported lazily by :func:`__getattr__`.
SUBMODULES = ("calibrate", "costmodel", "profile", "profiles", "schedule", "topologies",
              "traffic", "xla_flags")


def __getattr__(name: str) -> ModuleType:
    # PEP 562: ``jddp.perf.profile`` worked only after its own import statement (issue 35); the
    # submodules stay unimported until first read, so importing jddp stays light.
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(SUBMODULES))
