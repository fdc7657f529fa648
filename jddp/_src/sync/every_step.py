"""Phase 4 of the step, the sync policy: how replicas stay in step; :class:`EveryStep`, the default.

A sync policy is one frozen, hashable value the step calls unconditionally and that never touches
the reducer (like torchft's ``LocalSGD``); the protocol is
:class:`jddp._src.step.config.SyncPolicy`. :class:`EveryStep` is plain data parallelism, every
method the identity. A leaf below ``config`` (which holds the default): imports only the topology.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

from jddp._src.runtime.topology import Roles, Topology

HookPhase = Callable[[int], Hashable] | None


@dataclasses.dataclass(frozen=True)
class EveryStep:
    """Replicas agree every step: the reduced gradient updates every replica alike (DDP).
    The other sync policies are :func:`jddp.local_sgd.post_local_sgd` and
    :func:`jddp.local_sgd.diloco`."""

    islands: ClassVar[bool] = False  # one state, replicated (or sharded) over the whole mesh

    def phase_fn(self, hook_phase: HookPhase) -> HookPhase:
        """``step -> static phase``: the hook's own (``None``: one program)."""
        return hook_phase

    def split_phase(self, phase: Any, hook_phase: HookPhase) -> tuple[None, Any]:
        """``(this policy's part of the phase, the hook's phase)``: all of it is the hook's."""
        del hook_phase
        return None, phase

    def roles(self, topology: Topology, phase: None) -> Roles:
        """Every step reduces over the whole data mesh."""
        del phase
        return topology.roles(None)

    def build_state(self, ctx: Any, state: Any) -> Any:
        """The data-parallel state as it is (one copy, replicated or sharded)."""
        return state

    def state_specs(self, ctx: Any, state: Any, specs: Any) -> Any:
        """The data-parallel specs as they are."""
        return specs

    def replica_view(self, state: Any) -> Any:
        """The state: every replica holds all of it."""
        return state

    def island_state(self, ctx: Any, state: Any) -> Any:
        """The state: every device holds it as it is."""
        return state

    def after_update(self, ctx: Any, step: Any, state: Any, res: Any) -> tuple[Any, dict]:
        """Phase 4: nothing to do; the step's metrics and the bytes its reduction sent."""
        return state, {**res.metrics, **res.comm}

    def global_params(self, ctx: Any, state: Any) -> Any:
        """The parameters to evaluate or export: the state's (every replica's)."""
        return state.params
