"""Read the scheduled order of a compiled XLA program and find its gradient all-reduces.

XLA prints a compiled (post-optimisation, scheduled) module with
``jax.jit(f).lower(*args).compile().as_text()``. The ENTRY computation of that text lists its
instructions in the order the backend will issue them, so the text alone answers the questions a
data-parallel library cares about:

* how many all-reduces survived XLA's combiners, how large each is and where it sits;
* on GPU, where collectives are asynchronous (``all-reduce-start`` / ``all-reduce-done``), which
  compute ops (GEMMs) run while each all-reduce is in flight, and how many are in flight at once;
* on CPU and TPU, where the text shows plain synchronous ``all-reduce`` ops, how much dot/GEMM
  work is still scheduled after each all-reduce (the position-only notion of overlap).

Example::

    compiled = jax.jit(step).lower(params_like, batch_like).compile()
    sched = read_schedule(compiled.as_text())
    print(sched)                       # one row per all-reduce
    assert all(ar.dots_between for ar in sched.all_reduces[:-1])

XLA options apply per compile: ``lowered.compile(compiler_options={...})`` takes the names of
XLA's debug options without the leading ``--`` (unknown names raise ``INVALID_ARGUMENT``), e.g.
:data:`GPU_NO_OVERLAP` for the no-overlap control. ``XLA_FLAGS`` in the environment also works but
is read once per process, before the backend initialises.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

__all__ = [
    "GPU_NO_OVERLAP",
    "AllReduce",
    "Operand",
    "Schedule",
    "ScheduledOp",
    "compiled_text",
    "read_schedule",
]

#: ``compiler_options`` that make every GPU all-reduce synchronous: XLA still emits
#: ``all-reduce-start``/``all-reduce-done`` pairs, marks them ``"is_sync":true`` and schedules them
#: adjacent, so nothing overlaps. The control for "what does overlap buy".
GPU_NO_OVERLAP: Mapping[str, str] = {"xla_gpu_disable_async_collectives": "ALLREDUCE"}

# Bits per element of XLA primitive types; the HLO text names them as below.
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128, "token": 0, "opaque": 0}
_ARRAY_RE = re.compile(r"\b(pred|bf16|c64|c128|token|opaque|[suf]\d+|f\d+e\w*)\[([^\]]*)\]")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_INSTR_RE = re.compile(r"^\s+(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"\s*([a-z][\w\-]*)\(")
_CALLS_RE = re.compile(
    r"\b(?:calls|to_apply|body|condition|branch_computations|called_computations)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)
_NAME_RE = re.compile(r"%?([\w.\-]+)")
_TARGET_RE = re.compile(r'custom_call_target="([^"]*)"')
_OP_NAME_RE = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_GROUPS_RE = re.compile(r"replica_groups=(.*?)(?:, [a-z_]+=|$)")
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_IS_SYNC_RE = re.compile(r'"is_sync":\s*(true|false)')
# Custom-call targets that are matrix multiplications or convolutions (cuBLAS, cuBLASLt, cuDNN).
_DOT_TARGET_RE = re.compile(r"gemm|matmul|conv", re.IGNORECASE)
_DOT_OPCODES = frozenset({"dot", "convolution", "ragged-dot", "scaled-dot"})


class Operand(NamedTuple):
    """One array operand of an all-reduce.

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


class ScheduledOp(NamedTuple):
    """One instruction of the scheduled computation.

    Attributes:
        index: position in the computation's schedule (0 = first instruction).
        name: instruction name without ``%``.
        opcode: HLO opcode, e.g. ``"fusion"``, ``"all-reduce-start"``.
        is_dot: True when the op is, or calls a computation that contains, a ``dot`` or
            ``convolution``, or is a GEMM/convolution custom-call (cuBLAS, cuDNN). These are the
            "backward GEMMs" that an all-reduce should overlap with.
    """

    index: int  # type: ignore[assignment]  # shadows tuple.index; the schedule position reads best
    name: str
    opcode: str
    is_dot: bool


@dataclasses.dataclass(frozen=True)
class AllReduce:
    """One all-reduce in the schedule: a plain ``all-reduce`` or a start/done pair.

    Attributes:
        name: name of the ``all-reduce`` (or of the ``all-reduce-start``) instruction.
        index: schedule position of the all-reduce (of the start for a pair).
        done_index: schedule position of the ``all-reduce-done``; equals ``index`` for a plain
            all-reduce.
        operands: the reduced arrays; more than one for a tuple (variadic) all-reduce.
        asynchronous: True for a start/done pair.
        is_sync: True if XLA runs it synchronously: always for a plain all-reduce; for a pair,
            XLA's ``"is_sync"`` marker (set by ``--xla_gpu_disable_async_collectives`` and by
            XLA itself when nothing could be scheduled in between).
        between: every op scheduled strictly between start and done (empty unless asynchronous).
        dots_after: the dot/GEMM ops scheduled after the all-reduce has completed (after the done).
        dots_before: number of dot/GEMM ops scheduled before the all-reduce starts.
        op_name: the ``op_name`` metadata JAX attached (e.g. ``"jit(step)/shard_map/psum"``;
            it carries ``jax.named_scope`` names).
        replica_groups: XLA's replica-group text, as printed.
    """

    name: str
    index: int
    done_index: int
    operands: tuple[Operand, ...]
    asynchronous: bool
    is_sync: bool
    between: tuple[ScheduledOp, ...]
    dots_after: tuple[ScheduledOp, ...]
    dots_before: int
    op_name: str
    replica_groups: str

    @property
    def nbytes(self) -> int:
        """Total bytes reduced (sum over operands)."""
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
    def dots_between(self) -> int:
        """Number of dot/GEMM ops scheduled while this all-reduce is in flight."""
        return sum(op.is_dot for op in self.between)

    @property
    def overlapped(self) -> bool:
        """True if asynchronous, not marked sync, and at least one GEMM runs while in flight."""
        return self.asynchronous and not self.is_sync and self.dots_between > 0

    def __str__(self) -> str:
        kind = "sync" if not self.asynchronous else ("async,is_sync" if self.is_sync else "async")
        return (
            f"{self.name} @{self.index} [{kind}] {_fmt_bytes(self.nbytes)} "
            f"{', '.join(map(str, self.operands))}: {self.dots_between} dots between, "
            f"{len(self.dots_after)} after"
        )


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The scheduled order of one computation and the all-reduces in it.

    Attributes:
        computation: name of the computation read (the ENTRY computation by default).
        ops: every instruction, in schedule order.
        all_reduces: the all-reduces, in the order they start.
        max_in_flight: the largest number of asynchronous all-reduces started and not yet done
            at any point of the schedule (0 when all are plain all-reduces).
        nested_all_reduces: all-reduces found in other computations (loop bodies, branches);
            these are not in ``all_reduces``.
    """

    computation: str
    ops: tuple[ScheduledOp, ...]
    all_reduces: tuple[AllReduce, ...]
    max_in_flight: int
    nested_all_reduces: int

    @property
    def total_bytes(self) -> int:
        """Bytes reduced by all the all-reduces together."""
        return sum(a.nbytes for a in self.all_reduces)

    @property
    def num_dots(self) -> int:
        """Number of dot/GEMM ops in the computation."""
        return sum(op.is_dot for op in self.ops)

    def table(self) -> str:
        """A fixed-width table with one row per all-reduce."""
        head = (
            f"{self.computation}: {len(self.ops)} ops, {self.num_dots} dot ops, "
            f"{len(self.all_reduces)} all-reduces ({_fmt_bytes(self.total_bytes)}), "
            f"max {self.max_in_flight} in flight"
        )
        if self.nested_all_reduces:
            head += f", {self.nested_all_reduces} more in nested computations"
        rows = [("#", "pos", "done", "mode", "bytes", "operands", "dots between", "dots after")]
        for i, a in enumerate(self.all_reduces):
            mode = "sync" if not a.asynchronous else ("async*" if a.is_sync else "async")
            ops = ", ".join(map(str, a.operands))
            if len(ops) > 40:
                ops = f"{len(a.operands)} arrays, {','.join(sorted(set(a.dtypes)))}"
            rows.append(
                (
                    str(i),
                    str(a.index),
                    str(a.done_index),
                    mode,
                    _fmt_bytes(a.nbytes),
                    ops,
                    str(a.dots_between),
                    str(len(a.dots_after)),
                )
            )
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [head]
        lines += [
            "  " + "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows
        ]
        if any(a.asynchronous and a.is_sync for a in self.all_reduces):
            lines.append('  (async* = start/done pair marked "is_sync":true)')
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    opcode: str
    shape: str
    operands: tuple[str, ...]
    calls: tuple[str, ...]
    attrs: str


def read_schedule(
    source: Any,
    *,
    computation: str | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> Schedule:
    """Reads the schedule of a compiled XLA module and its all-reduces.

    Args:
        source: the text of a compiled module (``compiled.as_text()``), a
            ``jax.stages.Compiled``, or a ``jax.stages.Lowered`` (compiled here).
        computation: name of the computation to read (without ``%``); the ENTRY computation by
            default.
        compiler_options: XLA options for compiling a ``Lowered`` source, e.g.
            :data:`GPU_NO_OVERLAP`. Ignored for text and ``Compiled`` sources.

    Returns:
        The :class:`Schedule`.

    Raises:
        ValueError: if the text holds no such computation.
    """
    text = _as_text(source, compiler_options)
    comps, entry = _parse_module(text)
    name = computation or entry
    if name is None or name not in comps:
        raise ValueError(f"computation {name!r} not found; have {sorted(comps)[:10]}...")
    instrs = comps[name]
    by_name = {ins.name: ins for ins in instrs}
    has_dot = _dot_closure(comps)
    ops = tuple(
        ScheduledOp(i, ins.name, ins.opcode, _is_dot(ins, has_dot)) for i, ins in enumerate(instrs)
    )
    position = {op.name: op.index for op in ops}

    # Pair each start with its done (the done's only operand is the start).
    done_of = {}
    for ins in instrs:
        if ins.opcode in ("all-reduce-done", "async-done") and ins.operands:
            done_of[ins.operands[0]] = ins.name

    dot_positions = [op.index for op in ops if op.is_dot]
    result = []
    in_flight = max_in_flight = 0
    for op, ins in zip(ops, instrs, strict=True):
        if ins.opcode in ("all-reduce-done", "async-done"):
            start = by_name.get(ins.operands[0]) if ins.operands else None
            if start is not None and _is_all_reduce_start(start, comps):
                in_flight -= 1
            continue
        if ins.opcode == "all-reduce":
            done_index = op.index
            asynchronous, is_sync = False, True
        elif _is_all_reduce_start(ins, comps):
            done_name = done_of.get(ins.name)
            done_index = position[done_name] if done_name else len(ops)
            asynchronous = True
            match = _IS_SYNC_RE.search(ins.attrs)
            is_sync = bool(match and match.group(1) == "true")
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
        else:
            continue
        group = _GROUPS_RE.search(ins.attrs)
        op_name = _OP_NAME_RE.search(ins.attrs)
        result.append(
            AllReduce(
                name=ins.name,
                index=op.index,
                done_index=done_index,
                operands=tuple(_operands(ins, by_name, comps)),
                asynchronous=asynchronous,
                is_sync=is_sync,
                between=ops[op.index + 1 : done_index],
                dots_after=tuple(ops[i] for i in dot_positions if i > done_index),
                dots_before=sum(1 for i in dot_positions if i < op.index),
                op_name=op_name.group(1) if op_name else "",
                replica_groups=group.group(1) if group else "",
            )
        )
    nested = sum(
        1
        for cname, body in comps.items()
        if cname != name
        for ins in body
        if ins.opcode in ("all-reduce", "all-reduce-start")
    )
    return Schedule(name, ops, tuple(result), max_in_flight, nested)


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
    raise TypeError(f"expected HLO text, a Compiled or a Lowered, got {type(source).__name__}")


def _parse_module(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    """Splits module text into computations (instruction lists in print order)."""
    comps: dict[str, list[_Instr]] = {}
    entry = None
    current: list[_Instr] | None = None
    for line in text.splitlines():
        if current is None:
            header = _HEADER_RE.match(line)
            if header:
                current = comps.setdefault(header.group(2), [])
                if header.group(1):
                    entry = header.group(2)
            continue
        if line.startswith("}"):
            current = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            current.append(ins)
    return comps, entry


def _parse_instr(line: str) -> _Instr | None:
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
    calls: list[str] = []
    for c in _CALLS_RE.finditer(attrs):
        calls += [n.group(1) for n in _NAME_RE.finditer(c.group(1))]
    return _Instr(name, op.group(1), shape, operands, tuple(calls), attrs)


def _balanced_end(s: str, start: int) -> int:
    """Index just past the bracket that closes the one at ``start`` (ignores quoted text)."""
    depth = 0
    quoted = False
    for i in range(start, len(s)):
        ch = s[i]
        if ch == '"' and (i == 0 or s[i - 1] != "\\"):
            quoted = not quoted
        elif quoted:
            continue
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(s)


def _split_top(s: str) -> list[str]:
    """Splits at commas that are not nested in brackets."""
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[last:i].strip())
            last = i + 1
    parts.append(s[last:].strip())
    return parts


def _arrays(shape: str) -> list[Operand]:
    out = []
    # Drop /*index=5*/ comments so they are not read as arrays.
    for m in _ARRAY_RE.finditer(_COMMENT_RE.sub("", shape)):
        dtype = m.group(1)
        dims = tuple(int(d.strip().lstrip("<=")) for d in m.group(2).split(",") if d.strip())
        bits = _BITS.get(dtype)
        if bits is None:
            digits = re.match(r"[a-z]+(\d+)", dtype)
            bits = int(digits.group(1)) if digits else 0
        out.append(Operand(dtype, dims, math.ceil(math.prod(dims) * bits / 8)))
    return out


def _operands(
    ins: _Instr, by_name: Mapping[str, _Instr], comps: Mapping[str, Sequence[_Instr]]
) -> list[Operand]:
    if ins.opcode == "async-start":
        # Wrapped form: the reduced arrays are the operands of the all-reduce inside.
        for cname in ins.calls:
            for inner in comps.get(cname, ()):
                if inner.opcode in ("all-reduce", "all-reduce-start"):
                    inner_by_name = {i.name: i for i in comps[cname]}
                    return _operands(inner, inner_by_name, comps)
    out = []
    for name in ins.operands:
        producer = by_name.get(name)
        if producer is not None:
            out += _arrays(producer.shape)
    if not out:  # operands defined elsewhere: fall back to the result shape
        out = _arrays(ins.shape)
    return out


def _is_all_reduce_start(ins: _Instr, comps: Mapping[str, Sequence[_Instr]]) -> bool:
    if ins.opcode == "all-reduce-start":
        return True
    if ins.opcode == "async-start":
        return any(
            inner.opcode in ("all-reduce", "all-reduce-start")
            for c in ins.calls
            for inner in comps.get(c, ())
        )
    return False


def _dot_closure(comps: Mapping[str, Sequence[_Instr]]) -> dict[str, bool]:
    """For each computation, whether it (transitively) contains a dot/convolution/GEMM call."""
    memo: dict[str, bool] = {}

    def visit(name: str) -> bool:
        if name in memo:
            return memo[name]
        memo[name] = False  # breaks cycles; HLO call graphs are acyclic anyway
        memo[name] = any(_is_dot(ins, memo, visit) for ins in comps.get(name, ()))
        return memo[name]

    for name in comps:
        visit(name)
    return memo


def _is_dot(ins: _Instr, has_dot: Mapping[str, bool], visit: Any = None) -> bool:
    if ins.opcode in _DOT_OPCODES:
        return True
    if ins.opcode == "custom-call":
        target = _TARGET_RE.search(ins.attrs)
        if target and _DOT_TARGET_RE.search(target.group(1)):
            return True
    if ins.opcode in (
        "all-reduce",
        "all-reduce-start",
        "reduce",
        "reduce-window",
        "scatter",
        "sort",
        "map",
        "select-and-scatter",
        "reduce-scatter",
        "all-gather",
    ):
        return False  # their called computations are scalar reducers
    lookup = visit if visit is not None else (lambda c: has_dot.get(c, False))
    return any(lookup(c) for c in ins.calls)


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
