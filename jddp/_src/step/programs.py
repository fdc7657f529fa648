"""The program check across processes: every process must run the same collectives.

Before the first run of each compiled program of a multi-process job, every process publishes a
fingerprint of it (:class:`ProgramFingerprint`) and compares; only when they differ are the
collectives read (:class:`ProgramSignature`) and a :class:`ProgramMismatchError` raised
everywhere if they differ too (docs/report.md, "The program check across processes"). Cost: one
hash, one key-value write and one barrier per compiled program.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from jddp._src.introspect import jax_private

#: Seconds a process waits at the check for the others (they may still be compiling); override
#: with the environment variable ``JDDP_PROGRAM_CHECK_TIMEOUT``.
DEFAULT_TIMEOUT_S = 600.0
_ENV_TIMEOUT = "JDDP_PROGRAM_CHECK_TIMEOUT"
_PREFIX = "jddp/program_check"
_sequence = itertools.count()  # the n-th check of this process; every process makes the same


class ProgramMismatchError(RuntimeError):
    """Processes of one job compiled different step programs (raised on every process, before
    any collective of the program runs).

    Attributes:
      differing: the processes whose program differs from process 0's.
      index: position of the first differing collective in the program (``None`` when the
        collectives agree and only the bucket plans differ, or a process never arrived).
    """

    def __init__(self, message: str, differing: Sequence[int], index: int | None) -> None:
        super().__init__(message)
        self.differing = tuple(differing)
        self.index = index


class CollectiveSig(NamedTuple):
    """What must agree across processes about one collective of a compiled program."""

    kind: str
    operands: tuple[str, ...]  # e.g. ("f32[64,64]", "f32[64]")
    nbytes: int
    group_size: int  # -1: groups in a form the reader does not know (compared as printed)
    groups: str  # XLA's replica groups, as printed
    where: str  # "", "loop", "branch" or "loop, branch"
    bucket: int | None

    def __str__(self) -> str:
        ops = ", ".join(self.operands)
        if len(ops) > 60:
            ops = f"{len(self.operands)} arrays"
        bucket = "" if self.bucket is None else f" for bucket {self.bucket}"
        where = f", in a {self.where}" if self.where else ""
        size = (f"groups of {self.group_size}" if self.group_size >= 0
                else f"unknown groups ({self.groups})")
        return f"{self.kind} of {self.nbytes} bytes ({ops}){bucket} over {size}{where}"


class ProgramSignature(NamedTuple):
    """A compiled program's collectives (in program order) and bucket plan, read to explain a
    difference of fingerprints."""

    collectives: tuple[CollectiveSig, ...]
    buckets: tuple[tuple[str, ...], ...]

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:32]

    def describe(self) -> ProgramSignature:
        """Itself (a program that is already described)."""
        return self

    def to_json(self) -> str:
        return json.dumps([[list(c) for c in self.collectives], [list(b) for b in self.buckets]])

    @classmethod
    def from_json(cls, text: str) -> ProgramSignature:
        cols, buckets = json.loads(text)
        return cls(
            tuple(CollectiveSig(k, tuple(o), n, s, g, w, b) for k, o, n, s, g, w, b in cols),
            tuple(tuple(b) for b in buckets),
        )


@dataclasses.dataclass(frozen=True, eq=False)
class ProgramFingerprint:
    """A compiled program for the check: its fingerprint (a hash of the canonical HLO text and
    of the buckets), and its description on demand."""

    fingerprint: str
    text: str = dataclasses.field(repr=False)
    buckets: tuple[tuple[str, ...], ...] = ()

    def digest(self) -> str:
        return self.fingerprint

    @functools.cached_property
    def description(self) -> ProgramSignature:
        return describe(self.text, self.buckets)

    def describe(self) -> ProgramSignature:
        """The :class:`ProgramSignature` (parses the text once)."""
        return self.description


#: What :func:`exchange` compares: a digest on the happy path, a description on demand.
Checked = ProgramFingerprint | ProgramSignature


def signature(compiled: Any, plan: Any = None) -> ProgramFingerprint:
    """The :class:`ProgramFingerprint` of a compiled program (text, ``Compiled`` or
    ``Lowered``); nothing is parsed until a difference needs describing.

    Args:
      plan: the bucket plan the program was traced with (a ``BucketPlan``), if any.
    """
    from jddp._src.introspect import hlo  # the HLO reader loads when a program is checked

    text = hlo.read_text(compiled)
    buckets = () if plan is None else tuple(tuple(plan.paths[i] for i in b.indices)
                                            for b in plan.buckets)
    h = hashlib.sha256(hlo.canonical_text(text).encode())
    h.update(json.dumps(buckets).encode())
    return ProgramFingerprint(h.hexdigest()[:32], text, buckets)


def describe(compiled: Any, buckets: tuple[tuple[str, ...], ...] = ()) -> ProgramSignature:
    """The :class:`ProgramSignature` of a compiled program: its collectives, read from the HLO
    text (replica groups in a form the reader does not know count as size ``-1``, warned)."""
    from jddp._src.introspect import hlo

    out = []
    for c in hlo.collectives(compiled):
        groups = c.known_groups
        size = -1 if groups is None else len(groups[0]) if groups else 0
        where = ", ".join(w for w, on in (("loop", c.in_loop), ("branch", c.in_conditional)) if on)
        out.append(CollectiveSig(
            c.kind, tuple(str(o) for o in c.operands), int(c.nbytes), size, c.replica_groups,
            where, c.bucket,
        ))
    return ProgramSignature(tuple(out), tuple(buckets))


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _item(seq: Sequence[Any], i: int) -> str:
    return str(seq[i]) if i < len(seq) else "nothing (its program ends earlier)"


def describe_mismatch(
    ref: ProgramSignature, other: ProgramSignature, other_process: int,
    differing: Sequence[int], num_processes: int, what: str = "step program",
) -> ProgramMismatchError:
    """The error for processes whose program (``other`` on ``other_process``) differs from
    process 0's (``ref``)."""
    head = (f"The processes compiled different {what}s: process(es) {list(differing)} differ from "
            f"process 0 ({num_processes} processes). Their collectives would not match (Gloo "
            "aborts, NCCL hangs), so nothing was run.")
    index = _first_difference(ref.collectives, other.collectives)
    if index is not None:
        detail = (f" First difference at collective #{index} of {len(ref.collectives)}: process 0 "
                  f"has {_item(ref.collectives, index)}; process {other_process} has "
                  f"{_item(other.collectives, index)}.")
    else:
        detail = " Their collectives agree, but the gradient buckets hold different parameters."
    b = _first_difference(ref.buckets, other.buckets)
    if b is not None:
        detail += (f" Bucket plans: process 0 has {len(ref.buckets)} buckets, process "
                   f"{other_process} {len(other.buckets)}; bucket {b} holds "
                   f"{_paths(ref.buckets, b)} on process 0 and {_paths(other.buckets, b)} on "
                   f"process {other_process}.")
    fix = (" Build the same DataParallel (same options, the Buckets policy included) with the same "
           "loss on every process, and keep Python branches in the loss off process-local data "
           "and jax.process_index().")
    return ProgramMismatchError(head + detail + fix, differing, index)


def _paths(buckets: Sequence[Sequence[str]], b: int) -> str:
    if b >= len(buckets):
        return "nothing"
    paths = list(buckets[b])
    return str(paths if len(paths) <= 6 else paths[:6] + [f"... {len(paths) - 6} more"])


def timeout_s() -> float:
    value = os.environ.get(_ENV_TIMEOUT)
    return float(value) if value else DEFAULT_TIMEOUT_S


def check_across_processes(sig: Checked) -> None:
    """Raises :class:`ProgramMismatchError` on every process unless all run the same collectives
    (``sig``: a :class:`ProgramFingerprint` or a :class:`ProgramSignature`).

    Every process of the job must call this the same number of times, in the same order (it is
    called before the first run of each compiled step program). Nothing with one process.
    """
    if jax.process_count() == 1:
        return
    client = jax_private.coordination_client()  # the coordinator's key-value store
    if client is None:
        return
    exchange(client, sig, next(_sequence), jax.process_index(), jax.process_count(),
             timeout_s())


def exchange(client: Any, sig: Checked, seq: int, me: int, n: int, limit: float,
             what: str = "step program") -> None:
    """The check's protocol on a key-value ``client`` (``jax.distributed``'s, or a stand-in);
    raises :class:`ProgramMismatchError`.

    Args:
      seq: the check's number (the same on every process); me, n: this process, the count.
      limit: seconds to wait at the barrier for the others.
    """
    prefix = f"{_PREFIX}/{seq}"
    client.key_value_set(f"{prefix}/digest/{me}", sig.digest())
    try:
        client.wait_at_barrier(f"{prefix}/barrier", int(limit * 1000))
    except Exception as e:  # jax's runtime error; DEADLINE_EXCEEDED when someone never came
        raise _late_or_missing(client, prefix, e, seq, me, n, limit, what) from None
    digests = {int(k.rsplit("/", 1)[1]): v for k, v in
               client.key_value_dir_get(f"{prefix}/digest/")}
    if len(set(digests.values())) <= 1:
        return
    differing = sorted(p for p, d in digests.items() if d != digests[0])
    _explain(client, sig, prefix, me, n, differing, limit, what)


def _late_or_missing(client: Any, prefix: str, e: Exception, seq: int, me: int, n: int,
                     limit: float, what: str) -> ProgramMismatchError:
    """The error after a failed barrier: naming the processes that never came, or this one as
    the late one."""
    arrived = sorted(int(k.rsplit("/", 1)[1]) for k, _ in
                     client.key_value_dir_get(f"{prefix}/digest/"))
    missing = sorted(set(range(n)) - set(arrived))
    cause = (str(e).splitlines() or [""])[0][:200]
    if not missing:  # everyone arrived, this process too late: the others gave up
        return ProgramMismatchError(
            f"The check of {what} #{seq} (before its first run) failed: this process "
            f"(#{me}) reached it after the others stopped waiting ({_ENV_TIMEOUT}); it "
            "compiled much more slowly, or took another path to this program (a branch on "
            f"process-local data?). ({type(e).__name__}: {cause})", [me], None)
    return ProgramMismatchError(
        f"Process(es) {missing} did not reach the check of {what} #{seq} (before its first "
        f"run) within {limit:g} s; processes {arrived} did. They compiled fewer programs than this "
        f"one (a branch on process-local data?), or are stuck or still compiling (raise "
        f"{_ENV_TIMEOUT}). ({type(e).__name__}: {cause})", missing, None)


_UNREADABLE = "unreadable"


def _explain(client: Any, sig: Checked, prefix: str, me: int, n: int, differing: Sequence[int],
             limit: float, what: str) -> None:
    """Fingerprints differ: every process publishes its description and compares process 0's
    with the first differing one's. Raises :class:`ProgramMismatchError` if their collectives or
    bucket plans differ; warns (and returns) if they agree or cannot be described."""
    try:
        mine = sig.describe().to_json()
    except Exception as e:  # noqa: BLE001 - a reader's failure must not stop the run
        warnings.warn(f"jddp could not describe this process's {what} ({type(e).__name__}: "
                      f"{e}); the check across processes goes on without it.",
                      RuntimeWarning, stacklevel=4)
        mine = _UNREADABLE
    client.key_value_set(f"{prefix}/desc/{me}", mine)
    other = differing[0]

    def fetch(p: int) -> str:
        if p == me:
            return mine
        return client.blocking_key_value_get(f"{prefix}/desc/{p}", int(limit * 1000))

    ref, theirs = fetch(0), fetch(other)
    if _UNREADABLE in (ref, theirs):
        warnings.warn(
            f"The processes compiled different {what}s (process(es) {list(differing)} differ from "
            "process 0) and jddp could not read them to compare their collectives; the run goes "
            "on. If it then hangs or Gloo aborts, build the same DataParallel with the same loss "
            "on every process.", RuntimeWarning, stacklevel=4)
        return
    a, b = ProgramSignature.from_json(ref), ProgramSignature.from_json(theirs)
    if a != b:
        raise describe_mismatch(a, b, other, differing, n, what)
    warnings.warn(
        f"The processes compiled different {what}s with the same collectives (process(es) "
        f"{list(differing)} differ from process 0 outside them, e.g. a constant or a branch taken "
        "from process-local data or jax.process_index()); the run goes on, but the processes "
        "compute different things.", RuntimeWarning, stacklevel=4)
