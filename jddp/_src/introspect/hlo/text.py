"""The primitives of HLO text: arrays and their sizes, replica groups in every printed form,
the bucket scopes jddp names, the canonical text of a program, and splitting at the top level."""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

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
STARTS = {f"{k}-start": k for k in COLLECTIVE_KINDS}  # asynchronous starts: their kind

# Bits per element of XLA primitive types; the HLO text names them as below.
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128, "token": 0, "opaque": 0}
_ARRAY_RE = re.compile(r"\b(pred|bf16|c64|c128|token|opaque|[suf]\d+|f\d+e\w*)\[([^\]]*)\]")
COMMENT_RE = re.compile(r"/\*.*?\*/")
_IOTA_RE = re.compile(r"\[(?P<dims>[\d,]+)\]<=\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_LISTS_RE = re.compile(r"\{\s*(?:\{[\d,\s]*\}\s*(?:,\s*)?)*\}")
_BARE_IOTA_RE = re.compile(r"\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
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


def parse_arrays(text: str) -> tuple[Array, ...]:
    """The arrays (:class:`Array`) of an HLO type, e.g. two for ``"(f32[8,8]{1,0}, bf16[3]{0})"``.

    Layouts, tiling and ``/*index=N*/`` comments are ignored; dynamic dimensions (``<=8``) count
    at their bound.
    """
    out = []
    for m in _ARRAY_RE.finditer(COMMENT_RE.sub("", text)):
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
    for part in split_top(m.group("axes")):
        name, _, length = part.rpartition("=")
        names.append(_unquote(name))
        sizes.append(int(length))
    n = math.prod(sizes)
    ids = _mesh_device_ids(m.group("ids"), n)
    refs: dict[int, list[tuple[int, int] | None]] = {}
    for part in split_top(m.group("group")):
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
            at = balanced_end(text, value)
    parts.append(text[at:])
    return "".join(parts)


_SPECIAL = re.compile(r'["()\[\]{},]')  # all the callers look at: skip the rest in C


def unquoted(s: str, start: int = 0) -> Iterator[tuple[int, str, int]]:
    """Each bracket and comma of ``s`` from ``start`` outside quoted text, with the bracket depth
    after it (an opening bracket counts itself, a closing one no longer does)."""
    depth = 0
    quoted = False
    for m in _SPECIAL.finditer(s, start):
        i = m.start()
        ch = s[i]
        if ch == '"':
            if i == 0 or s[i - 1] != "\\":
                quoted = not quoted
            continue
        if quoted:
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        yield i, ch, depth


def balanced_end(s: str, start: int) -> int:
    """Index just past the bracket that closes the one at ``start`` (ignores quoted text)."""
    for i, ch, depth in unquoted(s, start):
        if ch in ")]}" and depth == 0:
            return i + 1
    return len(s)


def split_top(s: str) -> list[str]:
    """Splits at commas that are neither nested in brackets nor quoted; drops empty parts."""
    parts, last = [], 0
    for i, ch, depth in unquoted(s):
        if ch == "," and depth == 0:
            parts.append(s[last:i].strip())
            last = i + 1
    parts.append(s[last:].strip())
    return [p for p in parts if p]
