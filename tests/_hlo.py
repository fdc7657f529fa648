"""A minimal reader of compiled CPU HLO for the tests: the scheduled entry computation."""

from __future__ import annotations

import re
from typing import NamedTuple

_DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "pred": 1}
_SHAPE = re.compile(r"\b(f32|f16|bf16|f64|s32|u32|s8|pred)\[([0-9,]*)\]")


class Op(NamedTuple):
    name: str
    kind: str  # "all-reduce", "compute" (dot/convolution or a fusion holding one), "other"
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # result shapes (tuple results flattened)

    @property
    def nbytes(self) -> int:
        total = 0
        for dtype, dims in self.shapes:
            n = 1
            for d in dims:
                n *= d
            total += n * _DTYPE_BYTES[dtype]
        return total


def _computations(text: str) -> dict[str, str]:
    comps, name, body = {}, None, []
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m and not line.startswith(" "):
            name, body = m.group(1), []
            if line.startswith("ENTRY"):
                name = "ENTRY"
            continue
        if line.startswith("}"):
            if name is not None:
                comps[name] = "\n".join(body)
            name = None
            continue
        if name is not None:
            body.append(line)
    return comps


def entry_ops(text: str) -> list[Op]:
    """The entry computation's instructions in schedule order, classified."""
    comps = _computations(text)
    has_compute = {n: bool(re.search(r"\b(dot|convolution)\(", b)) for n, b in comps.items()}
    ops = []
    for line in comps["ENTRY"].splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\(", line)
        if not m:
            continue
        name, result, opcode = m.groups()
        shapes = tuple(
            (d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _SHAPE.findall(result)
        )
        if opcode in ("all-reduce", "all-reduce-start"):
            kind = "all-reduce"
        elif opcode in ("dot", "convolution"):
            kind = "compute"
        elif opcode == "fusion":
            called = re.search(r"calls=%([\w.\-]+)", line)
            kind = "compute" if called and has_compute.get(called.group(1)) else "other"
        else:
            kind = "other"
        ops.append(Op(name, kind, shapes))
    return ops


def all_reduces(text: str) -> list[Op]:
    return [op for op in entry_ops(text) if op.kind == "all-reduce"]


# An all-reduce instruction (the opcode, not an operand such as ``%all-reduce.3``).
_ALL_REDUCE = re.compile(r"^\s*(?:ROOT )?%\S+ = .*? all-reduce(?:-start)?\(", re.M)


def count_all_reduces(text: str) -> int:
    """All all-reduce instructions anywhere in the module (loop bodies included)."""
    return len(_ALL_REDUCE.findall(text))


_CALLED = re.compile(
    r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _callees(body: str) -> set[str]:
    names = set(_CALLED.findall(body))
    for group in _BRANCHES.findall(body):
        names.update(n.strip().lstrip("%") for n in group.split(","))
    return names


def _reachable(comps: dict[str, str], roots: set[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo.extend(_callees(comps[name]))
    return seen


def count_all_reduces_in_loops(text: str) -> int:
    """All-reduce instructions inside ``while`` bodies/conditions (and what they call)."""
    comps = _computations(text)
    loops = set()
    for body in comps.values():
        for line in body.splitlines():
            if re.search(r"\bwhile\(", line):
                loops.update(re.findall(r"(?:body|condition)=%([\w.\-]+)", line))
    return sum(
        len(_ALL_REDUCE.findall(comps[name]))
        for name in _reachable(comps, loops)
    )
