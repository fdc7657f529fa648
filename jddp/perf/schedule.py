"""Read compiled XLA (HLO) text: the scheduled order of a computation and its collectives.

XLA prints a compiled (post-optimisation, scheduled) module with
``jax.jit(f).lower(*args).compile().as_text()``. Each computation of that text lists its
instructions in the order the backend will issue them, so the text alone answers the questions a
data-parallel library cares about:

* which collectives survived XLA's combiners (``all-reduce``, ``all-gather``, ``reduce-scatter``,
  ``all-to-all``, ``collective-permute``), how large each is, over which replica groups, where
  it sits, and whether it runs inside a ``while`` loop or a ``conditional`` branch;
* on GPU, where collectives are asynchronous (``all-reduce-start`` / ``all-reduce-done``,
  ``all-gather-start`` / ``-done``, ``reduce-scatter-start`` / ``-done``, ...), which compute ops
  (GEMMs) run while each collective is in flight, and how many are in flight at once;
* on CPU and TPU, where the text shows plain synchronous ops, how much dot/GEMM work is still
  scheduled after each collective (the position-only notion of overlap).

This module is jddp's only reader of HLO text. Three levels, each built on the one below:

* :func:`read_module` splits the text into computations, lists of instructions
  (:class:`Instruction`: name, opcode, result arrays, operand names, called computations,
  attributes);
* :func:`collectives` lists every collective of the module as a :class:`Collective` (kind, operand
  bytes, replica groups, position, in a loop or branch or not); its groups are read in every form
  XLA prints (:func:`parse_replica_groups`: explicit lists, iota, the partitioner's mesh axes),
  and a form it does not know reads as unknown with an :class:`UnknownReplicaGroupsWarning`
  (:attr:`Collective.known_groups`) wherever jddp reads a program for itself;
* :func:`read_schedule` reads one computation (ENTRY by default) as a :class:`Schedule`: its ops in
  order, which of them are GEMMs, and its collectives with the ops scheduled around them.

Example::

    compiled = jax.jit(step).lower(params_like, batch_like).compile()
    sched = read_schedule(compiled.as_text())
    print(sched)                       # one row per collective
    assert all(ar.dots_between for ar in sched.all_reduces[:-1])
    assert not any(c.in_loop for c in collectives(compiled.as_text(), "all-reduce"))

XLA options apply per compile: ``lowered.compile(compiler_options={...})`` takes the names of
XLA's debug options without the leading ``--`` (unknown names raise ``INVALID_ARGUMENT``), e.g.
:data:`GPU_NO_OVERLAP` for the no-overlap control. ``XLA_FLAGS`` in the environment also works but
is read once per process, before the backend initialises.

Not understood: TPU's asynchronous collective fusions (an ``all-gather`` inside fusion
computations ending in ``AsyncCollectiveStart`` / ``AsyncCollectiveDone`` custom-calls) are
listed as the plain collectives inside those fusion computations, one per fusion.
"""

from jddp._src.introspect.hlo import (
    COLLECTIVE_KINDS,
    GPU_NO_OVERLAP,
    Array,
    Collective,
    Instruction,
    Module,
    Schedule,
    ScheduledOp,
    UnknownReplicaGroupsWarning,
    bucket_of,
    bucket_scope,
    collectives,
    compiled_text,
    parse_arrays,
    parse_replica_groups,
    read_module,
    read_schedule,
)

__all__ = [
    "COLLECTIVE_KINDS",
    "GPU_NO_OVERLAP",
    "Array",
    "Collective",
    "Instruction",
    "Module",
    "Schedule",
    "ScheduledOp",
    "UnknownReplicaGroupsWarning",
    "bucket_of",
    "bucket_scope",
    "collectives",
    "compiled_text",
    "parse_arrays",
    "parse_replica_groups",
    "read_module",
    "read_schedule",
]
