"""Every use of JAX's private modules (``jax._src``), each behind one small named function (an
upgrade of JAX reviews this file; a test checks no other module imports ``jax._src``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from jax import lax

# The module of JAX's collectives (psum, pmean, all_gather, axis_index, ...), whose frames name
# the axis they were called with. Why private: only its frames carry the axis name a failed
# collective was called with, which the error about an unbound axis reports.
COLLECTIVES_MODULE = "jax._src.lax.parallel"


def distributed_state() -> Any:
    """JAX's ``jax.distributed`` state: process id, count, coordinator address, client."""
    # Why private: jax.distributed exposes is_initialized() only, not the state it keeps.
    from jax._src import distributed

    return distributed.global_state


def coordination_client() -> Any:
    """The coordination service's client (key-value store, barriers), or None in one process."""
    # Why private: the client of the running jax.distributed job has no public accessor.
    return distributed_state().client


def shutdown_distributed() -> None:
    """Leaves ``jax.distributed`` (its shutdown barrier included), as JAX's own exit handler."""
    # Why private: the same call JAX's atexit handler makes, on the same module-level state.
    from jax._src import distributed

    distributed.shutdown()


def preemption_sync_manager(state: Any) -> Any:
    """The preemption sync manager of a ``distributed_state()`` (None if the service is off)."""
    # Why private: the manager is an attribute of the private distributed state.
    return state.preemption_sync_manager


def set_preemption_sync_manager(state: Any, manager: Any) -> None:
    """Replaces the preemption sync manager of a ``distributed_state()`` (jddp wraps it)."""
    # Why private: wrapping it is the only way to count the sync points JAX's own calls reach.
    state.preemption_sync_manager = manager


def user_context(traceback: Any) -> AbstractContextManager[Any]:
    """A context giving re-traced equations the user's traceback (``source_info_util``)."""
    # Why private: without it an error in a re-evaluated equation points into jddp, not the loss.
    from jax._src import source_info_util

    return source_info_util.user_context(traceback)


def _all_gather_invariant() -> Callable[..., Any]:
    # Why private: JAX exports no all_gather typed as the same on every replica under check_vma.
    try:
        from jax._src.lax.parallel import all_gather_invariant
    except ImportError:  # pragma: no cover - older/newer JAX without it
        return lax.all_gather
    return all_gather_invariant


#: ``all_gather`` whose result is typed as the same on every replica (``check_vma``).
all_gather_invariant: Callable[..., Any] = _all_gather_invariant()


def backends_are_initialized() -> bool:
    """Whether JAX's backends have started (after which device settings cannot change)."""
    # Why private: xla_bridge's query is the only one that does not itself start the backends.
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def register_gloo_cpu_backend(hostname: str | None, interface: str | None) -> None:
    """Registers a CPU backend whose Gloo collectives bind ``interface`` or ``hostname``.

    Raises:
      RuntimeError: the CPU backend already exists (JAX's message).
    """
    # Why private: JAX 0.10.2 creates Gloo collectives without them and has no public hook.
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    def factory() -> Any:
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=coordination_client(), hostname=hostname, interface=interface)
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", factory, priority=0, fail_quietly=False)


def running_in_cloud_tpu_vm() -> bool:
    """Whether JAX detected a Cloud TPU VM (where it picks the local devices itself)."""
    # Why private: JAX's own detection result, set when its TPU initialisation runs.
    try:
        from jax._src import cloud_tpu_init
    except ImportError:  # pragma: no cover - a JAX without it
        return False
    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


def hlo_cost(compiled: Any) -> dict[str, float]:
    """XLA's cost analysis (``flops``, ``bytes accessed``, ...) of a compiled step's optimized
    HLO module, run through the CPU client: for a compile-only executable (a GPU topology
    compiled without the GPU), whose own ``cost_analysis()`` returns nothing."""
    # Why private: HloCostAnalysis over an executable's module through another client has no
    # public entry; it is the analysis ``Compiled.cost_analysis()`` runs on a real device.
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    module = compiled.runtime_executable().hlo_modules()[0]
    return dict(_jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module))
