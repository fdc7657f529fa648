"""Introspection of JAX programs, fenced: the jaxpr evaluator, HLO reading, private JAX.

Everything in jddp that reads JAX's internals lives in this package, so a new JAX version is
checked here and nowhere else. Its internal API is its four modules, and other modules import
them only as ``from jddp._src.introspect import hlo, jax_private, jaxpr, vma`` (a test checks it):

- :mod:`~jddp._src.introspect.jaxpr`: the traced loss and the walks over it (first use of each
  parameter, gradient reachability, re-evaluation with hooks).
- :mod:`~jddp._src.introspect.hlo`: compiled XLA (HLO) text: its schedule and collectives.
- :mod:`~jddp._src.introspect.jax_private`: every access to ``jax._src``, one named function each.
- :mod:`~jddp._src.introspect.vma`: which mesh axes a value varies over, and casts between them.
"""

# hlo (the HLO reader) is imported where it is used (reports, program checks, jddp.perf), not
# with `import jddp`: a training step does not read compiled HLO.
from jddp._src.introspect import jax_private, jaxpr

__all__ = ["hlo", "jax_private", "jaxpr", "vma"]
