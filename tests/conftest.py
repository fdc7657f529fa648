"""Test set-up: 8 simulated CPU devices, before JAX initialises its backend."""

import os

import chex

# LLVM's optimisation level for XLA:CPU's generated code: 0 (and no expensive passes) in the tests,
# for this process and every subprocess that inherits the environment. Compilation dominates the
# suite (many small programs, each run a few times): level 0 takes ~36% less CPU time on
# tests/test_zero.py. What the tests check does not depend on it: the HLO (every collective, its
# bytes, the schedule) is optimised by XLA's own passes before code generation, and results are
# compared to tolerances, or bitwise between programs compiled the same way. The bitwise
# deterministic-mode tests set their own XLA_FLAGS for their children (the level users run; code at
# level 0 also runs the FMA-free AVX build ~2.5x slower); a flag already set wins.
# XLA:CPU's MLIR fusion emitters (on by default) run an MLIR pipeline for every fusion: the classic
# emitter compiles the suite's small step programs 2-3x faster. The optimised HLO is the same (every
# collective, fusion and the schedule) except that a lone elementwise op is not wrapped in a fusion
# of its own; results compared on a ZeRO-3 step with accumulation were bitwise equal.
# One LLVM module per program (no split for parallel codegen): splitting a small program into
# pieces compiled on a thread pool costs more than it saves on 2 cores (tests/test_zero.py: ~26%
# less CPU time); it changes how the machine code is compiled, not the HLO or the results.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0"
                               + " --xla_llvm_disable_expensive_passes=true"
                               + " --xla_cpu_use_fusion_emitters=false"
                               + " --xla_cpu_parallel_codegen_split_count=1").strip()

chex.set_n_cpu_devices(8)

# Test files whose later tests compare with results their earlier tests computed in the same
# process (functools.cache): test_matrix's 2-process test with the 1 x 8 runs of its cells,
# test_owner's with the matrix's owner cells. Collected first, they run at the head of the first
# pytest-xdist worker's queue (worksteal splits the collection in halves and steals from a queue's
# tail), not split between workers (in file order the halves' boundary fell inside test_matrix,
# and the other worker computed 11 of those 1 x 8 runs again).
FIRST = ("test_matrix.py", "test_owner.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: file order kept
