"""Read compiled XLA (HLO) text: the scheduled order of a computation and its collectives.

jddp's only reader of HLO text. Public as :mod:`jddp.perf.schedule`, whose docstring describes
it in full (what is read, examples); it lives here because the step itself reads its compiled
program (the program check across processes, ``ddp.report``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jddp._src.tree import fmt_bytes

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
    "canonical_text",
    "compiled_text",
    "known_groups",
    "parse_arrays",
    "parse_replica_groups",
    "read_module",
    "read_schedule",
    "read_text",
]

#: ``compiler_options`` that make every GPU all-reduce synchronous: XLA still emits
#: ``all-reduce-start``/``all-reduce-done`` pairs, marks them ``"is_sync":true`` and schedules them
#: adjacent, so nothing overlaps. The control for "what does overlap buy".
GPU_NO_OVERLAP: Mapping[str, str] = {"xla_gpu_disable_async_collectives": "ALLREDUCE"}

#: HLO opcodes of the collectives this reader recognises. Each may also appear as an asynchronous
#: ``<kind>-start`` / ``<kind>-done`` pair, or wrapped in ``async-start`` / ``async-done``.
COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)
_STARTS = {f"{k}-start": k for k in COLLECTIVE_KINDS}
_DONES = frozenset({f"{k}-done" for k in COLLECTIVE_KINDS} | {"async-done"})

# Bits per element of XLA primitive types; the HLO text names them as below.
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128, "token": 0, "opaque": 0}
_ARRAY_RE = re.compile(r"\b(pred|bf16|c64|c128|token|opaque|[suf]\d+|f\d+e\w*)\[([^\]]*)\]")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_INSTR_RE = re.compile(r"^\s+(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"\s*([a-z][\w\-]*)\(")
_NAME_RE = re.compile(r"%?([\w.\-]+)")
_OP_NAME_RE = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_IS_SYNC_RE = re.compile(r'"is_sync":\s*(true|false)')
_IOTA_RE = re.compile(r"\[(?P<dims>[\d,]+)\]<=\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_LISTS_RE = re.compile(r"\{\s*(?:\{[\d,\s]*\}\s*(?:,\s*)?)*\}")
_BARE_IOTA_RE = re.compile(r"\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
# Attributes naming the computations an instruction calls.
_CALL_ATTRS = (
    "calls",
    "to_apply",
    "body",
    "condition",
    "branch_computations",
    "true_computation",
    "false_computation",
    "called_computations",
)
_CALLS_HINT_RE = re.compile(rf"\b(?:{'|'.join(_CALL_ATTRS)})=")
# Custom-call targets that are matrix multiplications or convolutions (cuBLAS, cuBLASLt, cuDNN).
_DOT_TARGET_RE = re.compile(r"gemm|matmul|conv", re.IGNORECASE)
_DOT_OPCODES = frozenset({"dot", "convolution", "ragged-dot", "scaled-dot"})
# Ops whose called computations are scalar reducers or comparators, never GEMM work.
_NOT_DOT_CALLERS = frozenset(
    {"reduce", "reduce-window", "scatter", "sort", "map", "select-and-scatter"}
    | set(COLLECTIVE_KINDS)
    | set(_STARTS)
)


_BUCKET_SCOPE_RE = re.compile(r"\bjddp_bucket_(\d+)\b")


def bucket_scope(bucket: int) -> str:
    """The ``jax.named_scope`` name jddp gives the reduction of gradient bucket ``bucket``; it
    shows in the ``op_name`` of the bucket's collectives and in profiler traces."""
    return f"jddp_bucket_{int(bucket)}"


def bucket_of(op_name: str) -> int | None:
    """The gradient bucket a collective serves, read from its ``op_name`` (see
    :func:`bucket_scope`), or ``None`` for a collective outside every bucket's reduction."""
    match = _BUCKET_SCOPE_RE.search(op_name)
    return int(match.group(1)) if match else None


class Array(NamedTuple):
    """One array of an instruction's result or operands.

    Attributes:
        dtype: XLA element type, e.g. ``"f32"`` or ``"bf16"``.
        shape: dimensions.
        nbytes: size in bytes.
    """

    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction as printed, split into its parts.

    Attributes:
        name: instruction name without ``%``.
        opcode: HLO opcode, e.g. ``"fusion"``, ``"all-reduce-start"``.
        computation: name of the computation that holds it.
        shape: the result type as printed, e.g. ``"f32[4,8]{1,0}"`` or a tuple ``"(f32[2], s8[0])"``.
        operands: names of the operand instructions, in order.
        calls: names of the computations it calls (``calls``, ``to_apply``, ``body``,
            ``condition``, ``branch_computations``, ...).
        attrs: the text after the operand list (``, key=value, ...``), as printed.
    """

    name: str
    opcode: str
    computation: str
    shape: str
    operands: tuple[str, ...]
    calls: tuple[str, ...]
    attrs: str

    @functools.cached_property
    def results(self) -> tuple[Array, ...]:
        """The result arrays (a tuple-shaped result flattened, in order)."""
        return parse_arrays(self.shape)

    @functools.cached_property
    def attributes(self) -> Mapping[str, str]:
        """The ``key=value`` attributes, values as printed (e.g. ``{"replica_groups": "{{0,1}}"}``)."""
        out: dict[str, str] = {}
        last = ""
        for part in _split_top(self.attrs):
            key, eq, value = part.partition("=")
            if key.strip() == "device_ids" and out.get(last, "").startswith("mesh["):
                # The mesh form of replica groups holds a top-level comma:
                # mesh['x'=2,'y'=4], device_ids=([4,2]T(1,0)) {'x'}
                out[last] += f", {part}"
            elif eq:
                last = key.strip()
                out[last] = value.strip()
        return out

    @property
    def op_name(self) -> str:
        """The ``op_name`` metadata JAX attached (e.g. ``"jit(step)/shard_map/psum"``), or ``""``."""
        match = _OP_NAME_RE.search(self.attributes.get("metadata", ""))
        return match.group(1) if match else ""


@dataclasses.dataclass(frozen=True, eq=False)
class Module:
    """A compiled HLO module: its computations, each a list of instructions in schedule order.

    Attributes:
        computations: computation name -> its instructions, in print (schedule) order; the
            computations themselves in print order.
        entry: name of the ENTRY computation (``None`` if the text has none).
    """

    computations: Mapping[str, tuple[Instruction, ...]]
    entry: str | None

    @property
    def instructions(self) -> tuple[Instruction, ...]:
        """Every instruction of every computation, computation by computation in print order."""
        return tuple(ins for body in self.computations.values() for ins in body)

    def computation(self, name: str | None = None) -> tuple[Instruction, ...]:
        """The instructions of computation ``name`` (the ENTRY computation by default).

        Raises:
            ValueError: if the module holds no such computation.
        """
        name = name or self.entry
        if name is None or name not in self.computations:
            raise ValueError(
                f"computation {name!r} not found; have {sorted(self.computations)[:10]}..."
            )
        return self.computations[name]

    def reachable(self, roots: Iterable[str]) -> frozenset[str]:
        """The computations ``roots`` and every computation they call, transitively."""
        seen: set[str] = set()
        todo = list(roots)
        while todo:
            name = todo.pop()
            if name in seen or name not in self.computations:
                continue
            seen.add(name)
            todo.extend(c for ins in self.computations[name] for c in ins.calls)
        return frozenset(seen)

    @functools.cached_property
    def loop_computations(self) -> frozenset[str]:
        """Computations that run inside a ``while`` loop: bodies, conditions and what they call."""
        return self.reachable(c for ins in self.instructions if ins.opcode == "while"
                              for c in ins.calls)

    @functools.cached_property
    def branch_computations(self) -> frozenset[str]:
        """Computations that run inside a ``conditional``: its branches and what they call."""
        return self.reachable(c for ins in self.instructions if ins.opcode == "conditional"
                              for c in ins.calls)

    @functools.cached_property
    def branch_index(self) -> Mapping[str, int]:
        """For each computation inside a ``conditional``, the index of the branch that runs it
        (the innermost conditional's; ``lax.cond(pred, true_fn, false_fn)`` lowers to branch 0
        = ``false_fn``, branch 1 = ``true_fn``)."""
        out: dict[str, int] = {}
        for ins in self.instructions:
            if ins.opcode != "conditional":
                continue
            # A predicate's conditional prints true_computation first: branch 1.
            order = (1, 0) if "true_computation=" in ins.attrs else range(len(ins.calls))
            for i, branch in zip(order, ins.calls, strict=False):
                for name in self.reachable([branch]):
                    out.setdefault(name, i)
        return out

    @functools.cached_property
    def async_wrapped_computations(self) -> frozenset[str]:
        """Computations wrapped by ``async-start`` ops: their ops belong to the start/done pair."""
        return frozenset(c for ins in self.instructions if ins.opcode == "async-start"
                         for c in ins.calls)

    @functools.cached_property
    def has_dot(self) -> Mapping[str, bool]:
        """For each computation, whether it (transitively) holds a dot/convolution/GEMM call."""
        memo: dict[str, bool] = {}

        def visit(name: str) -> bool:
            if name not in memo:
                memo[name] = False  # breaks cycles; HLO call graphs are acyclic anyway
                memo[name] = any(_is_dot(ins, visit) for ins in self.computations.get(name, ()))
            return memo[name]

        for name in self.computations:
            visit(name)
        return memo

    def is_dot(self, ins: Instruction) -> bool:
        """True if ``ins`` is, or calls a computation holding, a dot, convolution or GEMM call."""
        return _is_dot(ins, lambda c: self.has_dot.get(c, False))


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


# ------------------------------------------------------------------------------ entry points


def read_module(source: Any, *, compiler_options: Mapping[str, Any] | None = None) -> Module:
    """Reads the computations and instructions of a compiled XLA module.

    Args:
        source: the text of a compiled module (``compiled.as_text()``), a
            ``jax.stages.Compiled``, a ``jax.stages.Lowered`` (compiled here), or a
            :class:`Module` (returned as is).
        compiler_options: XLA options for compiling a ``Lowered`` source, e.g.
            :data:`GPU_NO_OVERLAP`. Ignored for other sources.

    Returns:
        The :class:`Module`.

    Raises:
        TypeError: if ``source`` is none of the above.
    """
    if isinstance(source, Module):
        return source
    text = _as_text(source, compiler_options)
    comps: dict[str, list[Instruction]] = {}
    entry = None
    current: str | None = None
    for line in text.splitlines():
        if current is None:
            header = _HEADER_RE.match(line)
            if header:
                current = header.group(2)
                comps.setdefault(current, [])
                if header.group(1):
                    entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        ins = _parse_instr(line, current)
        if ins is not None:
            comps[current].append(ins)
    return Module({k: tuple(v) for k, v in comps.items()}, entry)


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


def compiled_text(
    fn: Any, *args: Any, compiler_options: Mapping[str, Any] | None = None, **kwargs: Any
) -> str:
    """Compiles ``fn`` for abstract or concrete arguments and returns the compiled HLO text.

    Args:
        fn: a jitted function (anything with ``.lower``); a plain function is wrapped in
            ``jax.jit``.
        *args: arguments, e.g. ``jax.ShapeDtypeStruct`` with shardings on compile-only devices.
        compiler_options: XLA debug options for this compile only (names without ``--``).
        **kwargs: keyword arguments for ``lower``.

    Returns:
        ``fn.lower(*args, **kwargs).compile(compiler_options).as_text()``.
    """
    if not hasattr(fn, "lower"):
        import jax

        fn = jax.jit(fn)
    lowered = fn.lower(*args, **kwargs)
    return _as_text(lowered, compiler_options)


def parse_arrays(text: str) -> tuple[Array, ...]:
    """The arrays (:class:`Array`) of an HLO type, e.g. two for ``"(f32[8,8]{1,0}, bf16[3]{0})"``.

    Layouts, tiling and ``/*index=N*/`` comments are ignored; dynamic dimensions (``<=8``) count
    at their bound.
    """
    out = []
    for m in _ARRAY_RE.finditer(_COMMENT_RE.sub("", text)):
        dtype = m.group(1)
        dims = tuple(int(d.strip().lstrip("<=")) for d in m.group(2).split(",") if d.strip())
        bits = _BITS.get(dtype)
        if bits is None:
            digits = re.match(r"[a-z]+(\d+)", dtype)
            bits = int(digits.group(1)) if digits else 0
        out.append(Array(dtype, dims, math.ceil(math.prod(dims) * bits / 8)))
    return tuple(out)


def parse_replica_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """The device ids of each replica group, from XLA's printed ``replica_groups`` value.

    Reads every form XLA prints:

    - explicit lists, ``{{0,1},{2,3}}``;
    - iota, ``[G,S]<=[N]`` (``G`` groups of ``S`` consecutive ids), also with a reshape and
      transpose, ``[G,S]<=[A,B]T(1,0)``;
    - mesh axes, ``mesh['x'=2,'y'=4] {'y'}`` (the partitioner's form: the devices of a named mesh,
      optionally ``, device_ids=(...)`` in another order, grouped over the listed axes, or
      sub-axes ``'x':(1)2``): a group holds the devices that share their position on every
      other axis.

    Returns:
        One tuple of device ids per group; empty for ``{}`` or ``""`` (which XLA uses for "every
        device in one group", without saying how many).

    Raises:
        ValueError: if the text is in none of these forms (:attr:`Collective.known_groups`
            reads such a collective's groups as unknown instead, with a warning).
    """
    text = text.strip()
    if text in ("", "{}"):
        return ()
    try:
        if text.startswith("mesh["):
            return _mesh_groups(text)
        if _IOTA_RE.fullmatch(text):
            shape = [int(d) for d in text[1:text.index("]")].split(",")]
            ids = _iota_ids(text).reshape(shape)  # type: ignore[union-attr]  # sizes must agree
            return _rows(ids.reshape(shape[0], -1))
        if _LISTS_RE.fullmatch(text):
            groups = re.findall(r"\{([\d,\s]*)\}", text[1:-1])
            return tuple(tuple(int(x) for x in g.split(",") if x.strip()) for g in groups)
    except (ValueError, IndexError) as e:  # malformed numbers, sizes that do not multiply
        raise ValueError(f"cannot read replica groups {text!r}: {e}") from None
    raise ValueError(f"cannot read replica groups {text!r}: a form this reader does not know")


class UnknownReplicaGroupsWarning(RuntimeWarning):
    """XLA printed a collective's replica groups in a form :func:`parse_replica_groups` does not
    know; the collective counts as "unknown groups" (nothing stops)."""


def known_groups(text: str, kind: str = "collective") -> tuple[tuple[int, ...], ...] | None:
    """:func:`parse_replica_groups` of ``text``, or ``None`` with an
    :class:`UnknownReplicaGroupsWarning` when the form is unknown (Python's warning filters
    decide how often it shows: once per place by default)."""
    try:
        return _parse_cached(text)
    except ValueError as e:
        warnings.warn(
            f"jddp could not read the replica groups of this {kind} ({e}); it is reported with "
            "unknown groups (group size 0, level 'unknown', no bytes sent counted) and nothing "
            "else changes. Please report this form of XLA's text.",
            UnknownReplicaGroupsWarning, stacklevel=3)
        return None


# A program reads the same few texts for many collectives (errors are not cached).
_parse_cached = functools.lru_cache(maxsize=256)(parse_replica_groups)

_MESH_RE = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]\s*(?:,\s*device_ids=\((?P<ids>[^()]*(?:\([\d,]*\))?)\))?"
    r"\s*\{(?P<group>[^{}]*)\}")
_AXIS_REF_RE = re.compile(r"(?P<name>'[^']*'|\"[^\"]*\"|[^\s:,()]+)(?::\((?P<pre>\d+)\)(?P<size>\d+))?")


def _rows(ids: np.ndarray) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(i) for i in row) for row in ids)


def _iota_ids(text: str) -> np.ndarray | None:
    """The flat ids of an iota form, ``[dims]<=[reshape]`` with an optional ``T(perm)``, or
    of XLA's bare ``[reshape]T(perm)`` (a mesh's ``device_ids``); ``None`` for other text."""
    m = _IOTA_RE.fullmatch(text) or _BARE_IOTA_RE.fullmatch(text)
    if m is None:
        return None
    dims = [int(d) for d in m.group("reshape").split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group("perm"):
        ids = ids.transpose([int(p) for p in m.group("perm").split(",")])
    return ids.reshape(-1)


def _mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Groups of XLA's mesh-axes form (``MeshAxesReplicaGroupList``): the mesh's device array,
    each grouped axis split where a sub-axis takes part of it, the grouped (sub-)axes moved last
    (in mesh-axis order, the listed order within one axis), then cut into groups."""
    m = _MESH_RE.fullmatch(text)
    if m is None:
        raise ValueError("not a mesh[...] {...} form")
    names, sizes = [], []
    for part in _split_top(m.group("axes")):
        name, _, length = part.rpartition("=")
        names.append(_unquote(name))
        sizes.append(int(length))
    n = math.prod(sizes)
    ids = _mesh_device_ids(m.group("ids"), n)
    refs: dict[int, list[tuple[int, int] | None]] = {}
    for part in _split_top(m.group("group")):
        ref = _AXIS_REF_RE.fullmatch(part)
        if ref is None or _unquote(ref.group("name")) not in names:
            raise ValueError(f"axis {part!r} is not an axis of the mesh {names}")
        sub = (int(ref.group("pre")), int(ref.group("size"))) if ref.group("pre") else None
        refs.setdefault(names.index(_unquote(ref.group("name"))), []).append(sub)
    dims: list[int] = []
    grouped: list[int] = []
    for axis, size in enumerate(sizes):
        split, aggregate = _split_axis(size, refs.get(axis))
        grouped += [len(dims) + a for a in aggregate]
        dims += split
    order = [d for d in range(len(dims)) if d not in grouped] + grouped
    per_group = math.prod(dims[d] for d in grouped)
    return _rows(ids.reshape(dims).transpose(order).reshape(-1, per_group))


def _mesh_device_ids(text: str | None, n: int) -> np.ndarray:
    """A mesh's devices in mesh order: ``0..n-1`` unless ``device_ids`` lists another order (an
    iota form, or every id)."""
    if text is None:
        return np.arange(n)
    ids = _iota_ids(text.strip())
    if ids is None:
        ids = np.array([int(x) for x in text.split(",") if x.strip()])
    if ids.size != n or sorted(ids.tolist()) != list(range(n)):
        raise ValueError(f"device_ids ({text}) are not a permutation of the mesh's {n} devices")
    return ids


def _split_axis(size: int, subs: list[tuple[int, int] | None] | None) -> tuple[list[int], list[int]]:
    """How one mesh axis of ``size`` is split for grouping, and which parts are grouped:
    ``(dims, grouped)``. ``subs``: the axis's references, ``None`` for the whole axis, else
    ``(pre_size, size)`` of a sub-axis (its ``pre_size`` major devices' worth of stride)."""
    if not subs:
        return [size], []
    if subs == [None]:
        return [size], [0]
    if None in subs:
        raise ValueError("an axis grouped whole and by sub-axes at once")
    by_pre = sorted(range(len(subs)), key=lambda i: subs[i][0])  # type: ignore[index]
    dims, at, done = [], [0] * len(subs), 1
    for i in by_pre:
        pre, part = subs[i]  # type: ignore[misc]
        if pre % done:
            raise ValueError(f"sub-axes of an axis of {size} overlap")
        if pre != done:
            dims.append(pre // done)
        at[i], done = len(dims), pre * part
        dims.append(part)
    if size % done:
        raise ValueError(f"sub-axes do not divide the axis of {size}")
    if done != size:
        dims.append(size // done)
    return dims, at


def _unquote(name: str) -> str:
    name = name.strip()
    return name[1:-1] if len(name) >= 2 and name[0] == name[-1] and name[0] in "'\"" else name


def read_text(source: Any, compiler_options: Mapping[str, Any] | None = None) -> str:
    """The HLO text of ``source`` (text, ``Compiled``, or ``Lowered``: compiled here)."""
    return _as_text(source, compiler_options)


# Metadata (op names, source lines) and backend configs (GPU autotuning choices, scheduling
# hints) may differ between processes that run the same collectives: not part of the fingerprint.
_METADATA_RE = re.compile(r', metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_BACKEND_CONFIG = ", backend_config="


def canonical_text(text: str) -> str:
    """The HLO text without ``metadata={...}`` and ``backend_config=...`` attributes."""
    text = _METADATA_RE.sub("", text)
    parts, at = [], 0
    while (start := text.find(_BACKEND_CONFIG, at)) >= 0:
        parts.append(text[at:start])
        value = start + len(_BACKEND_CONFIG)
        if text.startswith('"', value):  # a quoted string value
            end = value + 1
            while end < len(text) and text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            at = end + 1
        else:
            at = _balanced_end(text, value)
    parts.append(text[at:])
    return "".join(parts)



# ---------------------------------------------------------------------------- implementation


def _as_text(source: Any, compiler_options: Mapping[str, Any] | None) -> str:
    if isinstance(source, str):
        return source
    if hasattr(source, "compile") and hasattr(source, "as_text"):  # jax.stages.Lowered
        options = dict(compiler_options) if compiler_options else None
        source = source.compile(compiler_options=options)
    if hasattr(source, "as_text"):
        text = source.as_text()
        if text is None:
            raise ValueError("the compiled object has no HLO text")
        return text
    raise TypeError(
        f"expected HLO text, a Compiled, a Lowered or a Module, got {type(source).__name__}"
    )


def _parse_instr(line: str, computation: str) -> Instruction | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    name, rest = m.group(2), m.group(3)
    # The shape is either a balanced "( ... )" tuple or one token without spaces.
    if rest.startswith("("):
        end = _balanced_end(rest, 0)
        shape, rest = rest[:end], rest[end:]
    else:
        shape, _, rest = rest.partition(" ")
    op = _OPCODE_RE.match(rest)
    if not op:
        return None
    open_at = op.end() - 1
    close = _balanced_end(rest, open_at)
    # Long operand lists carry /*index=N*/ comments; drop them before reading names.
    operand_text = _COMMENT_RE.sub("", rest[open_at + 1 : close - 1])
    attrs = rest[close:]
    operands = tuple(
        n.group(1)
        for part in _split_top(operand_text)
        if part and (n := _NAME_RE.search(part.split()[-1]))
    )
    ins = Instruction(name, op.group(1), computation, shape, operands, (), attrs)
    if not _CALLS_HINT_RE.search(attrs):
        return ins
    calls = tuple(
        n.group(1)
        for key in _CALL_ATTRS
        if key in ins.attributes
        for n in _NAME_RE.finditer(ins.attributes[key])
    )
    return dataclasses.replace(ins, calls=calls) if calls else ins


def _unquoted(s: str, start: int = 0) -> Iterator[tuple[int, str, int]]:
    """Each character of ``s`` from ``start`` outside quoted text, with the bracket depth after
    it (an opening bracket counts itself, a closing one no longer does)."""
    depth = 0
    quoted = False
    for i in range(start, len(s)):
        ch = s[i]
        if ch == '"' and (i == 0 or s[i - 1] != "\\"):
            quoted = not quoted
            continue
        if quoted:
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        yield i, ch, depth


def _balanced_end(s: str, start: int) -> int:
    """Index just past the bracket that closes the one at ``start`` (ignores quoted text)."""
    for i, ch, depth in _unquoted(s, start):
        if ch in ")]}" and depth == 0:
            return i + 1
    return len(s)


def _split_top(s: str) -> list[str]:
    """Splits at commas that are neither nested in brackets nor quoted; drops empty parts."""
    parts, last = [], 0
    for i, ch, depth in _unquoted(s):
        if ch == "," and depth == 0:
            parts.append(s[last:i].strip())
            last = i + 1
    parts.append(s[last:].strip())
    return [p for p in parts if p]


def _is_dot(ins: Instruction, calls_dot: Any) -> bool:
    if ins.opcode in _DOT_OPCODES:
        return True
    if ins.opcode == "custom-call":
        target = ins.attributes.get("custom_call_target", "").strip('"')
        if _DOT_TARGET_RE.search(target):
            return True
    if ins.opcode in _NOT_DOT_CALLERS:
        return False  # their called computations are scalar reducers
    return any(calls_dot(c) for c in ins.calls)


def _wrapped_collective(ins: Instruction, module: Module) -> Instruction | None:
    """The collective inside the computation an ``async-start`` wraps, if any."""
    for cname in ins.calls:
        for inner in module.computations.get(cname, ()):
            if inner.opcode in COLLECTIVE_KINDS or inner.opcode in _STARTS:
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
                start.opcode in _STARTS or _wrapped_collective(start, module) is not None
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
            if ins.opcode in _STARTS:
                kind = _STARTS[ins.opcode]
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
            ins.opcode in COLLECTIVE_KINDS or ins.opcode in _STARTS or ins.opcode == "async-start"
            for ins in body
        ):
            continue
        found += _read_computation(module, name)[1]
    return tuple(found)
