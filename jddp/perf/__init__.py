"""Performance tooling for jddp: predicting, measuring and inspecting a data-parallel step.

Nothing here is needed to train; the training API is the top of ``jddp``. This subpackage holds
what helps choose a configuration and check what XLA made of it:

- :mod:`jddp.perf.costmodel`: a pure alpha-beta cost model of one data-parallel iteration
  (``ModelProfile``, ``ClusterSpec``, ``Link``, ``simulate_iteration``) and the bucket-size
  advisor built on it (``advise_bucket_cap``, ``suggest_bucket_cap``).
- :mod:`jddp.perf.calibrate`: measures the cost model's inputs on the current machine (a step's
  compute per gradient leaf, an alpha-beta fit of all-reduce times) and the alternated timing
  loop the benchmarks use.
- :mod:`jddp.perf.profiles`: gradient profiles of reference models (ResNet-50, BERT-large), built
  from their architectures, for predictions without the model.
- :mod:`jddp.perf.schedule`: the reader of compiled XLA (HLO) text: the scheduled order of a
  computation, its collectives (all-reduce, all-gather, reduce-scatter, ... with their bytes,
  replica groups and position) and how much backward compute overlaps them.
- :mod:`jddp.perf.xla_flags`: the XLA options that keep a bucket plan intact, per backend.
- :mod:`jddp.perf.profile`: where a real step's time goes: host dispatch, device time, and a
  ``jax.profiler`` trace with each bucket's collectives named and timed.
- :mod:`jddp.perf.topologies`: compile-only GPU and TPU meshes, to compile (not run) a step for
  hardware this machine does not have.

Each module is imported on first use: ``import jddp.perf`` alone imports none of them (they pull
in the profiler, HLO readers and compile-only topologies that training does not need), and
``jddp.perf.profile.StepTimer(...)`` after ``import jddp`` (or ``import jddp.perf``) imports
:mod:`jddp.perf.profile` when the attribute is first read; ``from jddp.perf import costmodel``
works as well.
"""

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
