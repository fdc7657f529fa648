"""Bytes a compiled step moves inside hosts and across them, read from its collectives.

Public as :mod:`jddp.perf.traffic`, whose docstring describes it in full (what is read, the model,
examples); it lives here because the step itself reads its compiled program (the program
check across processes, ``ddp.report``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from jddp._src.core.bytemodel import fmt_bytes, ring_bytes

if TYPE_CHECKING:  # the HLO reader loads when traffic is read, not with `import jddp`
    from jddp._src.introspect.hlo import Collective

__all__ = ["CollectiveTraffic", "Traffic", "sent_per_device", "traffic"]


class CollectiveTraffic(NamedTuple):
    """One collective's bytes, per host.

    Attributes:
      collective: the collective (kind, operands, replica groups, position).
      inside: bytes a host's devices send to each other for it (average over hosts).
      across: bytes a host sends to other hosts for it (average over hosts).
      crosses: whether any of its groups spans hosts.
    """

    collective: Collective
    inside: float
    across: float
    crosses: bool


class Traffic(NamedTuple):
    """A compiled program's collective bytes per host, inside and across hosts.

    Attributes:
      inside: bytes a host's devices send to each other (per step, average over hosts).
      across: bytes a host sends to other hosts.
      collectives: the part of each collective, in program order.
      hosts: the number of hosts.
    """

    inside: float
    across: float
    collectives: tuple[CollectiveTraffic, ...]
    hosts: int

    def by_kind(self, crosses: bool | None = None) -> dict[str, int]:
        """Count of collectives of each kind (only those that cross hosts, or only those that do
        not, when ``crosses`` is given)."""
        out: dict[str, int] = {}
        for c in self.collectives:
            if crosses is None or c.crosses == crosses:
                out[c.collective.kind] = out.get(c.collective.kind, 0) + 1
        return out

    def table(self) -> str:
        """One row per collective, and the totals."""
        rows = [f"{'#':>3} {'kind':<15} {'operands':>11} {'group':>5} {'level':<7} "
                f"{'inside/host':>12} {'across/host':>12}"]
        for i, c in enumerate(self.collectives):
            groups = c.collective.known_groups
            size = len(groups[0]) if groups else 0
            rows.append(
                f"{i:>3} {c.collective.kind:<15} {fmt_bytes(c.collective.nbytes):>11} {size:>5} "
                f"{'across' if c.crosses else 'inside':<7} {fmt_bytes(c.inside):>12} "
                f"{fmt_bytes(c.across):>12}"
            )
        rows.append(f"total per host: {fmt_bytes(self.inside)} inside, {fmt_bytes(self.across)} "
                    f"across ({self.hosts} hosts)")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def sent_per_device(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes one device sends in a ring collective of ``kind`` over ``group_size`` devices whose
    operands total ``nbytes`` per device (see the module docstring; the same model as the
    ``comm_bytes`` metric)."""
    return ring_bytes(kind, nbytes, group_size)


def traffic(source: Any, host_of_device: Sequence[int]) -> Traffic:
    """The bytes per host, inside and across hosts, of every collective of a compiled program.

    Args:
      source: compiled HLO text, or a ``jax.stages.Lowered``/``Compiled`` (see
        :func:`jddp.perf.schedule.read_module`).
      host_of_device: the host of each device position of the program (XLA's replica-group ids),
        e.g. ``jddp.mesh.host_of_device(mesh)``.
    """
    host = list(host_of_device)
    hosts = max(1, len(set(host)))
    out = []
    total_in = total_across = 0.0
    from jddp._src.introspect.hlo import collectives

    for c in collectives(source):
        known = c.known_groups
        # Unknown groups (a form hlo cannot read, warned there): no bytes counted, not crossing.
        groups = () if known is None else known or (tuple(range(len(host))),)
        inside = across = 0.0
        crosses = False
        for group in groups:
            per_device = sent_per_device(c.kind, c.nbytes, len(group))
            if c.kind in ("all-to-all", "ragged-all-to-all") and len(group) > 1:
                # Not a ring: each device sends its 1/g share straight to every other member.
                share = per_device / (len(group) - 1)
                for dev in group:
                    remote = sum(host[dev] != host[peer] for peer in group)
                    across += share * remote
                    inside += share * (len(group) - 1 - remote)
                    crosses = crosses or remote > 0
                continue
            for j, dev in enumerate(group):
                nxt = group[(j + 1) % len(group)]
                if len(group) == 1:
                    continue
                if host[dev] != host[nxt]:
                    across += per_device
                    crosses = True
                else:
                    inside += per_device
        out.append(CollectiveTraffic(c, inside / hosts, across / hosts, crosses))
        total_in += inside / hosts
        total_across += across / hosts
    return Traffic(total_in, total_across, tuple(out), hosts)
