"""Introspection of JAX programs, fenced: the jaxpr evaluator, HLO reading, private JAX.

Everything that reads JAX's internals lives here, imported only as ``from jddp._src.introspect
import hlo, jax_private, jaxpr, vma`` (a test checks it), so a new JAX is checked here alone.
"""

# hlo (the HLO reader) is imported where it is used (reports, program checks, jddp.perf), not
# with `import jddp`: a training step does not read compiled HLO.
from jddp._src.introspect import jax_private, jaxpr

__all__ = ["hlo", "jax_private", "jaxpr", "vma"]
