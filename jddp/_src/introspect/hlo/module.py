"""A compiled HLO module read into computations and instructions (:func:`read_module`)."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

from jddp._src.introspect.hlo.text import (
    COLLECTIVE_KINDS,
    COMMENT_RE,
    STARTS,
    Array,
    balanced_end,
    parse_arrays,
    split_top,
)

#: ``compiler_options`` that make every GPU all-reduce synchronous: XLA still emits
#: ``all-reduce-start``/``all-reduce-done`` pairs, marks them ``"is_sync":true`` and schedules them
#: adjacent, so nothing overlaps. The control for "what does overlap buy".
GPU_NO_OVERLAP: Mapping[str, str] = {"xla_gpu_disable_async_collectives": "ALLREDUCE"}
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_INSTR_RE = re.compile(r"^\s+(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"\s*([a-z][\w\-]*)\(")
NAME_RE = re.compile(r"%?([\w.\-]+)")
_OP_NAME_RE = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
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
    | set(STARTS)
)


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
        for part in split_top(self.attrs):
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
                memo[name] = any(is_dot_op(ins, visit) for ins in self.computations.get(name, ()))
            return memo[name]

        for name in self.computations:
            visit(name)
        return memo

    def is_dot(self, ins: Instruction) -> bool:
        """True if ``ins`` is, or calls a computation holding, a dot, convolution or GEMM call."""
        return is_dot_op(ins, lambda c: self.has_dot.get(c, False))


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
    text = read_text(source, compiler_options)
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
    return read_text(lowered, compiler_options)


def read_text(source: Any, compiler_options: Mapping[str, Any] | None = None) -> str:
    """The HLO text of ``source`` (text, ``Compiled``, or ``Lowered``: compiled here)."""
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
        end = balanced_end(rest, 0)
        shape, rest = rest[:end], rest[end:]
    else:
        shape, _, rest = rest.partition(" ")
    op = _OPCODE_RE.match(rest)
    if not op:
        return None
    open_at = op.end() - 1
    close = balanced_end(rest, open_at)
    # Long operand lists carry /*index=N*/ comments; drop them before reading names.
    operand_text = COMMENT_RE.sub("", rest[open_at + 1 : close - 1])
    attrs = rest[close:]
    operands = tuple(
        n.group(1)
        for part in split_top(operand_text)
        if part and (n := NAME_RE.search(part.split()[-1]))
    )
    ins = Instruction(name, op.group(1), computation, shape, operands, (), attrs)
    if not _CALLS_HINT_RE.search(attrs):
        return ins
    calls = tuple(
        n.group(1)
        for key in _CALL_ATTRS
        if key in ins.attributes
        for n in NAME_RE.finditer(ins.attributes[key])
    )
    return dataclasses.replace(ins, calls=calls) if calls else ins


def is_dot_op(ins: Instruction, calls_dot: Any) -> bool:
    if ins.opcode in _DOT_OPCODES:
        return True
    if ins.opcode == "custom-call":
        target = ins.attributes.get("custom_call_target", "").strip('"')
        if _DOT_TARGET_RE.search(target):
            return True
    if ins.opcode in _NOT_DOT_CALLERS:
        return False  # their called computations are scalar reducers
    return any(calls_dot(c) for c in ins.calls)
