"""``ddp.report(state, batch)``: the compiled step's communication contract, and its memory.

Read from the program the step runs: each collective of the compiled HLO (kind, bytes, groups,
bucket, loop/branch), its ring bytes (:mod:`jddp._src.plan.traffic`) and
``compiled.memory_analysis()``. Unlike ``metrics["comm_bytes"]`` it counts every collective, also
those jddp does not issue (docs/report.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from jddp._src.core.bytemodel import device_nbytes, fmt_bytes
from jddp._src.plan.traffic import sent_per_device, traffic


class CollectiveReport(NamedTuple):
    """One collective of the compiled step.

    Attributes:
      index: position in the program (computation by computation, in schedule order).
      kind: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``, ...
      bytes: operand bytes per device (what each device puts in).
      dtype: the operands' element types (``"f32"``, or ``"f32,bf16"``).
      shapes: the operands' shapes.
      group_size: devices per replica group (0: unknown, see ``level``).
      level: ``"hosts"`` when a replica group spans hosts, else ``"local"``; ``"unknown"`` when
        XLA printed the groups in a form jddp cannot read (warned; ``sent`` and
        ``across_hosts`` then count 0 for it, see :attr:`Report.unknown_groups`).
      bucket: the gradient bucket whose reduction issued it (``None``: outside every bucket):
        read from the ``op_name`` jddp gives each bucket's reduction, or, where XLA drops it
        (GPU's asynchronous collectives), matched to the plan by bytes in order.
      in_loop: it runs inside a ``while`` loop (once per iteration; totals count it once).
      in_branch: it runs inside a ``conditional`` (with accumulation and ``sync=None``: the
        synchronising branch once per window, the accumulating one on the window's other calls).
      sent: bytes one device sends for it (ring model).
      across_hosts: bytes one host sends to other hosts for it (ring model, mean over hosts).
      mode: ``"sync"`` (a plain op), ``"async"`` (start/done pair) or ``"async*"`` (marked sync).
      overlapped_dots: GEMMs/convolutions scheduled while it is in flight (asynchronous only:
        the backward compute that hides it, on GPU).
    """

    index: int  # type: ignore[assignment]  # shadows tuple.index; a position reads best
    kind: str
    bytes: int
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    group_size: int
    level: str
    bucket: int | None
    in_loop: bool
    in_branch: bool
    sent: float
    across_hosts: float
    mode: str
    overlapped_dots: int
    branch: int | None = None  # the conditional's branch: 1 synchronises, 0 accumulates


class MemoryReport(NamedTuple):
    """Per-device memory of the compiled step, in bytes.

    Attributes:
      at_rest: the training state one device holds between steps.
      arguments: the program's inputs (state, batch, ...).
      outputs: its outputs.
      aliased: outputs written over donated inputs (counted in both above).
      temporaries: XLA's scratch space during the step.
      peak: ``arguments + outputs - aliased + temporaries``, the most the step holds at once.
      generated_code: the executable's code size.
      host_at_rest: the part of the state placed in host memory, per device
        (``jddp.ZeRO(offload=True)``'s optimizer state; not counted in ``at_rest``).
      host_peak: host memory the program holds at once, per device (XLA's host figures:
        ``arguments + outputs - aliased + temporaries``; 0 where the backend keeps every memory
        kind in one memory and counts it above, as XLA:CPU does).
    """

    at_rest: int
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    peak: int
    generated_code: int
    host_at_rest: int = 0
    host_peak: int = 0


class Report(NamedTuple):
    """The compiled step's collectives, their totals, and its memory (see ``ddp.report``).

    Attributes:
      collectives: every collective, in program order.
      memory: per-device memory (``None`` where the backend gives no analysis).
      num_devices: devices of the data mesh.
      hosts: hosts of the mesh (processes, or rows of a two-level mesh).
      window: calls of ``step`` per synchronisation (``accumulate_steps``).
      owners: with ``jddp.ZeRO(shard="owner")``, the owner plan (each leaf's owner device, the
        share of the update each device runs, the leaves too large to balance); else ``None``.
    """

    collectives: tuple[CollectiveReport, ...]
    memory: MemoryReport | None
    num_devices: int
    hosts: int
    window: int
    owners: Any = None

    def _total(self, field: str) -> float:
        """Per window: collectives outside a branch run on every call, those inside the
        synchronising branch once per window, those inside the accumulating branch (branch 0 of
        ``lax.cond(synced, sync, accumulate)``: a sharded accumulator's reduce-scatters, stage
        3's gathers) on the window's other ``window - 1`` calls."""
        every = sum(getattr(c, field) for c in self.collectives if not c.in_branch)
        once = sum(getattr(c, field) for c in self.collectives if c.in_branch and c.branch != 0)
        rest = sum(getattr(c, field) for c in self.collectives if c.in_branch and c.branch == 0)
        if self.window <= 1:
            return every + once + rest
        return self.window * every + once + (self.window - 1) * rest

    @property
    def bytes_per_window(self) -> float:
        """Operand bytes per device of the collectives of one synchronisation window."""
        return self._total("bytes")

    @property
    def bytes_per_step(self) -> float:
        """:attr:`bytes_per_window` per call of ``step``."""
        return self.bytes_per_window / self.window

    @property
    def sent_per_window(self) -> float:
        """Bytes one device sends per window (ring model; ``metrics["comm_bytes"]`` plus the
        collectives jddp does not issue, see the module docstring)."""
        return self._total("sent")

    @property
    def sent_per_step(self) -> float:
        return self.sent_per_window / self.window

    @property
    def across_hosts_per_window(self) -> float:
        """Bytes one host sends to other hosts per window (0 with one host)."""
        return self._total("across_hosts")

    @property
    def unknown_groups(self) -> tuple[CollectiveReport, ...]:
        """The collectives whose replica groups XLA printed in a form jddp cannot read: their
        bytes count, their sent bytes do not (an empty tuple unless XLA changes its text)."""
        return tuple(c for c in self.collectives if c.level == "unknown")

    def by_bucket(self) -> dict[int, list[CollectiveReport]]:
        """The collectives of each gradient bucket."""
        out: dict[int, list[CollectiveReport]] = {}
        for c in self.collectives:
            if c.bucket is not None:
                out.setdefault(c.bucket, []).append(c)
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (``json.dumps(rep.to_dict())``)."""
        return {
            "num_devices": self.num_devices, "hosts": self.hosts, "window": self.window,
            "collectives": [c._asdict() for c in self.collectives],
            "bytes_per_step": self.bytes_per_step, "bytes_per_window": self.bytes_per_window,
            "sent_per_step": self.sent_per_step, "sent_per_window": self.sent_per_window,
            "across_hosts_per_window": self.across_hosts_per_window,
            "unknown_groups": len(self.unknown_groups),
            "memory": None if self.memory is None else self.memory._asdict(),
            **({} if self.owners is None else {"owners": self.owners.by_path()}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def __str__(self) -> str:
        head = (f"Step program: {self.num_devices} devices, {self.hosts} host(s), "
                f"{len(self.collectives)} collectives"
                + (f", a window of {self.window} calls" if self.window > 1 else ""))
        rows = [("#", "kind", "bytes", "dtype", "group", "level", "bucket", "where", "sent/dev",
                 "across/host", "mode", "overlap")]
        for c in self.collectives:
            where = ",".join(w for w, on in (("loop", c.in_loop), ("branch", c.in_branch)) if on)
            rows.append((str(c.index), c.kind, fmt_bytes(c.bytes), c.dtype,
                         str(c.group_size) if c.level != "unknown" else "?",
                         c.level, "-" if c.bucket is None else str(c.bucket), where or "-",
                         fmt_bytes(c.sent), fmt_bytes(c.across_hosts), c.mode,
                         f"{c.overlapped_dots} dots" if c.mode == "async" else "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head] + ["  " + "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True))
                          for r in rows]
        lines.append(f"per step: {fmt_bytes(self.bytes_per_step)} in collectives, "
                     f"{fmt_bytes(self.sent_per_step)} sent per device, "
                     f"{fmt_bytes(self.across_hosts_per_window / self.window)} across hosts per "
                     "host" + (f" (per window of {self.window}: "
                               f"{fmt_bytes(self.bytes_per_window)}, "
                               f"{fmt_bytes(self.sent_per_window)} sent)"
                               if self.window > 1 else ""))
        if self.unknown_groups:
            lines.append(f"{len(self.unknown_groups)} collective(s) with unknown replica groups "
                         "(a form of XLA's text jddp cannot read): their bytes sent are not "
                         "counted above")
        m = self.memory
        if m is not None:
            lines.append(f"memory per device: at rest {fmt_bytes(m.at_rest)}; arguments "
                         f"{fmt_bytes(m.arguments)}, outputs {fmt_bytes(m.outputs)} (aliased "
                         f"{fmt_bytes(m.aliased)}), temporaries {fmt_bytes(m.temporaries)}, "
                         f"peak {fmt_bytes(m.peak)}")
            if m.host_at_rest or m.host_peak:
                lines.append(f"host memory per device: at rest {fmt_bytes(m.host_at_rest)}, "
                             f"peak {fmt_bytes(m.host_peak)}")
        if self.owners is not None:
            lines.append("owners (each leaf's update runs on one device):")
            lines += ["  " + line for line in str(self.owners).splitlines()]
        return "\n".join(lines)


def memory(compiled: Any, state: Any) -> MemoryReport | None:
    """:class:`MemoryReport` of a ``jax.stages.Compiled`` for ``state`` (``None`` if the backend
    gives no analysis)."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # backends without the analysis raise (e.g. some compile-only targets)
        ma = None
    if ma is None:
        return None
    args, outs = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
    alias, temp = int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes)
    import jax

    from jddp._src.place import offload

    host = [int(getattr(ma, f"host_{f}_size_in_bytes", 0) or 0)
            for f in ("argument", "output", "alias", "temp")]
    leaves = jax.tree.leaves(state)
    on_host = [x for x in leaves if offload.on_host(x)]
    return MemoryReport(device_nbytes(state) - device_nbytes(on_host), args,
                        outs, alias, temp, args + outs - alias + temp,
                        int(ma.generated_code_size_in_bytes),
                        host_at_rest=device_nbytes(on_host),
                        host_peak=host[0] + host[1] - host[2] + host[3])


def collectives(source: Any, host_of_device: Sequence[int]) -> tuple[CollectiveReport, ...]:
    """The :class:`CollectiveReport` of every collective of a compiled program."""
    from jddp._src.introspect import hlo  # the HLO reader loads with the first report

    host = list(host_of_device)
    out = []
    for i, t in enumerate(traffic(hlo.read_module(source), host).collectives):
        c = t.collective
        groups = c.known_groups
        # Unknown groups (warned by hlo): size 0, level "unknown", no bytes sent counted.
        size = 0 if groups is None else len((groups or (tuple(range(len(host))),))[0])
        level = "unknown" if groups is None else "hosts" if t.crosses else "local"
        out.append(CollectiveReport(
            index=i, kind=c.kind, bytes=int(c.nbytes),
            dtype=",".join(sorted(set(c.dtypes))), shapes=c.shapes, group_size=size,
            level=level, bucket=c.bucket, in_loop=c.in_loop, in_branch=c.in_conditional,
            sent=sent_per_device(c.kind, c.nbytes, size) if size else 0.0,
            across_hosts=t.across, mode=c.mode,
            overlapped_dots=c.dots_between if c.asynchronous else 0, branch=c.branch,
        ))
    return tuple(out)


def assign_buckets(cols: Sequence[CollectiveReport], plan: Any) -> tuple[CollectiveReport, ...]:
    """Buckets for collectives whose ``op_name`` was dropped (XLA's GPU asynchronous
    collectives keep only a scheduling name): the gradient collectives (all-reduce,
    reduce-scatter; not in a loop), in program order, fill the plan's buckets in order, by
    bytes (a bucket XLA split in two gets both pieces)."""
    if plan is None or any(c.bucket is not None for c in cols):
        return tuple(cols)
    out, b, filled = [], 0, 0
    for c in cols:
        if b < plan.num_buckets and c.kind in ("all-reduce", "reduce-scatter") and not c.in_loop:
            c = c._replace(bucket=b)
            filled += c.bytes
            if filled >= plan.buckets[b].nbytes:
                b, filled = b + 1, 0
        out.append(c)
    return tuple(out)


def build(compiled: Any, state: Any, host_of_device: Sequence[int], window: int,
          plan: Any = None, owners: Any = None) -> Report:
    """The :class:`Report` of a compiled step for ``state`` on a mesh whose devices sit on
    ``host_of_device``; ``plan`` (the step's bucket plan) names buckets the program's metadata
    does not; ``owners``: the owner plan of ``jddp.ZeRO(shard="owner")``."""
    cols = assign_buckets(collectives(compiled.as_text(), host_of_device), plan)
    return Report(cols, memory(compiled, state), len(host_of_device),
                  max(1, len(set(host_of_device))), int(window), owners)
