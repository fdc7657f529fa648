"""The schedule of a computation and every collective of a module: kind, bytes, replica
groups, overlap with dot ops, loops and conditionals (:func:`read_schedule`, :func:`collectives`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from jddp._src.core.bytemodel import fmt_bytes
from jddp._src.introspect.hlo.module import Instruction, Module, read_module
from jddp._src.introspect.hlo.text import (
    COLLECTIVE_KINDS,
    STARTS,
    Array,
    bucket_of,
    known_groups,
    parse_replica_groups,
)

_DONES = frozenset({f"{k}-done" for k in COLLECTIVE_KINDS} | {"async-done"})
_IS_SYNC_RE = re.compile(r'"is_sync":\s*(true|false)')


class ScheduledOp(NamedTuple):
    """One instruction of a scheduled computation.

    Attributes:
        index: position in the computation's schedule (0 = first instruction).
        name: instruction name without ``%``.
        opcode: HLO opcode, e.g. ``"fusion"``, ``"all-reduce-start"``.
        is_dot: True when the op is, or calls a computation that contains, a ``dot`` or
            ``convolution``, or is a GEMM/convolution custom-call (cuBLAS, cuDNN). These are the
            "backward GEMMs" that a gradient collective should overlap with.
        op_name: the ``op_name`` metadata JAX attached; JAX names ops of the backward
            (transposed) pass ``transpose(...)``.
    """

    index: int  # type: ignore[assignment]  # shadows tuple.index; the schedule position reads best
    name: str
    opcode: str
    is_dot: bool
    op_name: str = ""


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective: a plain op (``all-reduce``, ``all-gather``, ...) or a start/done pair.

    Attributes:
        kind: the collective's opcode without ``-start``: one of :data:`COLLECTIVE_KINDS`.
        name: name of the instruction (of the start for a pair).
        computation: name of the computation that holds it.
        index: schedule position in that computation (of the start for a pair).
        done_index: schedule position of the done; equals ``index`` for a plain collective (the
            computation's length if the done was not found).
        operands: the arrays sent; more than one for a tuple (variadic) collective.
        results: the arrays received (for a pair, the done's result).
        asynchronous: True for a start/done pair.
        is_sync: True if XLA runs it synchronously: always for a plain collective; for a pair,
            XLA's ``"is_sync"`` marker (set by ``--xla_gpu_disable_async_collectives`` and by
            XLA itself when nothing could be scheduled in between).
        between: every op scheduled strictly between start and done (empty unless asynchronous).
        dots_after: the dot/GEMM ops scheduled after the collective has completed (after the done).
        dots_before: number of dot/GEMM ops scheduled before the collective starts.
        op_name: the ``op_name`` metadata JAX attached (e.g. ``"jit(step)/shard_map/psum"``;
            it carries ``jax.named_scope`` names).
        replica_groups: XLA's replica-group text, as printed (``""`` if the op has none, e.g. a
            ``collective-permute``); :attr:`groups` parses it.
        in_loop: True if its computation runs inside a ``while`` loop (body, condition, or a
            computation they call).
        in_conditional: True if its computation runs inside a branch of a ``conditional``.
        instruction: the instruction (the start for a pair), for any other attribute.
        branch: the index of that branch (:attr:`Module.branch_index`), ``None`` outside one.
    """

    kind: str
    name: str
    computation: str
    index: int
    done_index: int
    operands: tuple[Array, ...]
    results: tuple[Array, ...]
    asynchronous: bool
    is_sync: bool
    between: tuple[ScheduledOp, ...]
    dots_after: tuple[ScheduledOp, ...]
    dots_before: int
    op_name: str
    replica_groups: str
    in_loop: bool
    in_conditional: bool
    instruction: Instruction = dataclasses.field(repr=False, compare=False)
    branch: int | None = None

    @property
    def nbytes(self) -> int:
        """Total bytes of the operands (what each device sends in)."""
        return sum(o.nbytes for o in self.operands)

    @property
    def dtypes(self) -> tuple[str, ...]:
        """Element type of each operand."""
        return tuple(o.dtype for o in self.operands)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shape of each operand."""
        return tuple(o.shape for o in self.operands)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The device ids of each replica group (see :func:`parse_replica_groups`).

        Raises:
            ValueError: if XLA printed them in a form this reader does not know (see
                :attr:`known_groups`).
        """
        return parse_replica_groups(self.replica_groups)

    @property
    def known_groups(self) -> tuple[tuple[int, ...], ...] | None:
        """:attr:`groups`, or ``None`` (with a warning) when XLA printed them in a form this
        reader does not know: what reads a program to describe it (``ddp.report``, the program
        check, :mod:`jddp.perf.traffic`) counts such a collective as "unknown groups" and goes
        on."""
        return known_groups(self.replica_groups, self.kind)

    @property
    def bucket(self) -> int | None:
        """The jddp gradient bucket this collective serves (from its ``op_name``), or ``None``."""
        return bucket_of(self.op_name)

    @property
    def dots_between(self) -> int:
        """Number of dot/GEMM ops scheduled while this collective is in flight."""
        return sum(op.is_dot for op in self.between)

    @property
    def overlapped(self) -> bool:
        """True if asynchronous, not marked sync, and at least one GEMM runs while in flight."""
        return self.asynchronous and not self.is_sync and self.dots_between > 0

    @property
    def mode(self) -> str:
        """``"sync"`` (plain op), ``"async"`` (start/done pair) or ``"async*"`` (pair marked sync)."""
        if not self.asynchronous:
            return "sync"
        return "async*" if self.is_sync else "async"

    def __str__(self) -> str:
        return (
            f"{self.kind} {self.name} @{self.index} [{self.mode}] {fmt_bytes(self.nbytes)} "
            f"{', '.join(map(str, self.operands))}: {self.dots_between} dots between, "
            f"{len(self.dots_after)} after"
        )


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The scheduled order of one computation and the collectives in it.

    Attributes:
        computation: name of the computation read (the ENTRY computation by default).
        ops: every instruction, in schedule order.
        collectives: the collectives of this computation (every kind), in the order they start.
        nested: the collectives of the module's other computations (loop bodies, branches,
            called computations); not in ``collectives``.
        max_in_flight: the largest number of asynchronous collectives (of any kind) started and
            not yet done at any point of the schedule (0 when all are plain ops).
    """

    computation: str
    ops: tuple[ScheduledOp, ...]
    collectives: tuple[Collective, ...]
    nested: tuple[Collective, ...]
    max_in_flight: int

    @property
    def all_reduces(self) -> tuple[Collective, ...]:
        """The all-reduces of this computation, in the order they start."""
        return self.of_kind("all-reduce")

    @property
    def nested_all_reduces(self) -> int:
        """Number of all-reduces in the module's other computations."""
        return sum(c.kind == "all-reduce" for c in self.nested)

    def of_kind(self, kind: str) -> tuple[Collective, ...]:
        """The collectives of one kind (e.g. ``"reduce-scatter"``), in the order they start."""
        return tuple(c for c in self.collectives if c.kind == kind)

    @property
    def total_bytes(self) -> int:
        """Operand bytes of all the collectives of this computation together."""
        return sum(c.nbytes for c in self.collectives)

    @property
    def num_dots(self) -> int:
        """Number of dot/GEMM ops in the computation."""
        return sum(op.is_dot for op in self.ops)

    def table(self) -> str:
        """A fixed-width table with one row per collective."""
        counts: dict[str, int] = {}
        for c in self.collectives:
            counts[c.kind] = counts.get(c.kind, 0) + 1
        kinds = ", ".join(f"{n} {k}{'s' if n != 1 else ''}" for k, n in counts.items())
        head = (
            f"{self.computation}: {len(self.ops)} ops, {self.num_dots} dot ops, "
            f"{kinds or 'no collectives'} ({fmt_bytes(self.total_bytes)}), "
            f"max {self.max_in_flight} in flight"
        )
        if self.nested:
            head += f", {len(self.nested)} more in nested computations"
        rows = [("#", "kind", "pos", "done", "mode", "bytes", "operands", "dots between",
                 "dots after")]
        for i, c in enumerate(self.collectives):
            ops = ", ".join(map(str, c.operands))
            if len(ops) > 40:
                ops = f"{len(c.operands)} arrays, {','.join(sorted(set(c.dtypes)))}"
            rows.append(
                (
                    str(i),
                    c.kind,
                    str(c.index),
                    str(c.done_index),
                    c.mode,
                    fmt_bytes(c.nbytes),
                    ops,
                    str(c.dots_between),
                    str(len(c.dots_after)),
                )
            )
        widths = [max(len(r[col]) for r in rows) for col in range(len(rows[0]))]
        lines = [head]
        lines += [
            "  " + "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows
        ]
        if any(c.mode == "async*" for c in self.collectives):
            lines.append('  (async* = start/done pair marked "is_sync":true)')
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def read_schedule(
    source: Any,
    *,
    computation: str | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> Schedule:
    """Reads the schedule of one computation of a compiled XLA module and its collectives.

    Args:
        source: anything :func:`read_module` takes (text, ``Compiled``, ``Lowered``, ``Module``).
        computation: name of the computation to read (without ``%``); the ENTRY computation by
            default.
        compiler_options: XLA options for compiling a ``Lowered`` source, e.g.
            :data:`GPU_NO_OVERLAP`. Ignored for other sources.

    Returns:
        The :class:`Schedule`.

    Raises:
        ValueError: if the text holds no such computation.
    """
    module = read_module(source, compiler_options=compiler_options)
    name = computation or module.entry or ""
    module.computation(name)  # raises if missing
    ops, found, max_in_flight = _read_computation(module, name)
    nested = tuple(c for c in _all_collectives(module) if c.computation != name)
    return Schedule(name, ops, found, nested, max_in_flight)


def collectives(
    source: Any,
    kind: str | None = None,
    *,
    compiler_options: Mapping[str, Any] | None = None,
) -> tuple[Collective, ...]:
    """Every collective of a compiled XLA module, in every computation.

    Collectives inside computations wrapped by ``async-start`` are reported once, as the
    ``async-start``/``async-done`` pair that runs them.

    Args:
        source: anything :func:`read_module` takes (text, ``Compiled``, ``Lowered``, ``Module``).
        kind: only collectives of this kind (one of :data:`COLLECTIVE_KINDS`, e.g.
            ``"all-reduce"``); all kinds by default.
        compiler_options: XLA options for compiling a ``Lowered`` source. Ignored otherwise.

    Returns:
        The collectives, computation by computation in print order (the ENTRY computation is
        usually printed last), each computation's in the order they start. Use
        :attr:`Collective.in_loop` / :attr:`Collective.in_conditional` to tell where they run.

    Raises:
        ValueError: if ``kind`` is not a collective kind.
    """
    if kind is not None and kind not in COLLECTIVE_KINDS:
        raise ValueError(f"kind must be one of {COLLECTIVE_KINDS}, got {kind!r}")
    found = _all_collectives(read_module(source, compiler_options=compiler_options))
    return tuple(c for c in found if kind is None or c.kind == kind)


def _wrapped_collective(ins: Instruction, module: Module) -> Instruction | None:
    """The collective inside the computation an ``async-start`` wraps, if any."""
    for cname in ins.calls:
        for inner in module.computations.get(cname, ()):
            if inner.opcode in COLLECTIVE_KINDS or inner.opcode in STARTS:
                return inner
    return None


def _operand_arrays(
    ins: Instruction, by_name: Mapping[str, Instruction], fallback: Sequence[Array]
) -> tuple[Array, ...]:
    out: list[Array] = []
    for name in ins.operands:
        producer = by_name.get(name)
        if producer is not None:
            out += producer.results
    return tuple(out) if out else tuple(fallback)


def _read_computation(
    module: Module, name: str
) -> tuple[tuple[ScheduledOp, ...], tuple[Collective, ...], int]:
    """(ops, collectives, max in flight) of one computation."""
    instrs = module.computations[name]
    by_name = {ins.name: ins for ins in instrs}
    ops = tuple(
        ScheduledOp(i, ins.name, ins.opcode, module.is_dot(ins), ins.op_name)
        for i, ins in enumerate(instrs)
    )
    position = {op.name: op.index for op in ops}
    # Pair each start with its done (the done's only operand is the start).
    done_of = {ins.operands[0]: ins for ins in instrs if ins.opcode in _DONES and ins.operands}
    dot_positions = [op.index for op in ops if op.is_dot]
    in_loop = name in module.loop_computations
    in_conditional = name in module.branch_computations

    found = []
    in_flight = max_in_flight = 0
    for op, ins in zip(ops, instrs, strict=True):
        if ins.opcode in _DONES:
            start = by_name.get(ins.operands[0]) if ins.operands else None
            if start is not None and (
                start.opcode in STARTS or _wrapped_collective(start, module) is not None
            ):
                in_flight -= 1
            continue
        described = ins
        if ins.opcode in COLLECTIVE_KINDS:
            kind = ins.opcode
            operands = _operand_arrays(ins, by_name, ins.results)
            results = ins.results
            done_index, asynchronous, is_sync = op.index, False, True
        else:
            if ins.opcode in STARTS:
                kind = STARTS[ins.opcode]
                operands = _operand_arrays(ins, by_name, ())
            elif ins.opcode == "async-start" and (inner := _wrapped_collective(ins, module)):
                kind = inner.opcode.removesuffix("-start")
                inner_by_name = {i.name: i for i in module.computations[inner.computation]}
                operands = _operand_arrays(inner, inner_by_name, inner.results)
                if "replica_groups" not in ins.attributes:
                    described = inner
            else:
                continue
            done = done_of.get(ins.name)
            done_index = position[done.name] if done is not None else len(ops)
            results = done.results if done is not None else ()
            asynchronous = True
            match = _IS_SYNC_RE.search(ins.attrs)
            is_sync = bool(match and match.group(1) == "true")
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
        found.append(
            Collective(
                kind=kind,
                name=ins.name,
                computation=name,
                index=op.index,
                done_index=done_index,
                operands=operands,
                results=results,
                asynchronous=asynchronous,
                is_sync=is_sync,
                between=ops[op.index + 1 : done_index],
                dots_after=tuple(ops[i] for i in dot_positions if i > done_index),
                dots_before=sum(1 for i in dot_positions if i < op.index),
                op_name=described.op_name or ins.op_name,
                replica_groups=described.attributes.get("replica_groups", ""),
                in_loop=in_loop,
                in_conditional=in_conditional,
                instruction=ins,
                branch=module.branch_index.get(name) if in_conditional else None,
            )
        )
    return ops, tuple(found), max_in_flight


def _all_collectives(module: Module) -> tuple[Collective, ...]:
    found: list[Collective] = []
    for name, body in module.computations.items():
        if name in module.async_wrapped_computations or not any(
            ins.opcode in COLLECTIVE_KINDS or ins.opcode in STARTS or ins.opcode == "async-start"
            for ins in body
        ):
            continue
        found += _read_computation(module, name)[1]
    return tuple(found)
