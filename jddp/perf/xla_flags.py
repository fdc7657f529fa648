"""XLA options that keep jddp's bucket plan intact in the compiled step, per backend.

``jddp.DataParallel`` sets them itself on a GPU mesh; for a step compiled another way:

    from jddp.perf import xla_flags

    rec = xla_flags.recommended("gpu", plan=ddp.plan(params, batch))   # or cap_mb=50
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + rec.xla_flags).strip()
    # before JAX initialises its backend; or, per compile:
    ddp.lower(params, batch).compile(compiler_options=rec.compiler_options)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jddp._src.api import options
from jddp._src.reduce import xla_options
from jddp.buckets import BucketPlan

__all__ = ["GPU_COMBINE_THRESHOLD_BYTES", "Recommendation", "recommended"]

#: XLA's default ``xla_gpu_all_reduce_combine_threshold_bytes`` (measured: docs/api/perf.md).
GPU_COMBINE_THRESHOLD_BYTES = xla_options.GPU_COMBINE_THRESHOLD_BYTES

_GPU = ("gpu", "cuda", "rocm")
_OTHER = ("tpu", "cpu")


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """XLA options for one backend and bucket cap.

    Attributes:
        compiler_options: options for ``Lowered.compile(compiler_options=...)`` or
            ``jax.jit(..., compiler_options=...)``; names without the leading ``--``.
        xla_flags: the same as text for the ``XLA_FLAGS`` environment variable (read once per
            process, before JAX initialises its backend); empty when nothing is needed.
        reasons: one sentence per option, saying why it is set (or why nothing is).
    """

    compiler_options: Mapping[str, Any]
    xla_flags: str
    reasons: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.compiler_options)


def recommended(
    backend: str, cap_mb: float | None = None, *, plan: BucketPlan | None = None, **renamed: Any
) -> Recommendation:
    """The XLA options jddp recommends for ``backend`` and a bucket plan (or cap).

    Like DDP, a bucket is closed by the leaf that reaches the cap, so it can exceed the cap by
    less than its last leaf: pass the ``plan`` (``ddp.plan(params, batch)``) to size the options
    to the largest bucket that will actually run; with only a cap they assume a bucket of the cap.

    Args:
        backend: ``"gpu"`` (also ``"cuda"``, ``"rocm"``), ``"tpu"`` or ``"cpu"``, e.g.
            ``jax.default_backend()``.
        cap_mb: the bucket cap of the step's ``jddp.Buckets(cap_mb=...)`` (MiB; default 25);
            ``bucket_cap_mb`` is its deprecated name.
        plan: the bucket plan the step uses (overrides ``cap_mb``).

    Returns:
        A :class:`Recommendation`. On GPU with buckets that exceed XLA's combine threshold
        (above about 29 MiB), it raises ``xla_gpu_all_reduce_combine_threshold_bytes`` to the
        largest bucket plus 1 MiB, rounded up to whole MiB; otherwise it is empty.

    Raises:
        ValueError: for an unknown backend or an invalid cap.
    """
    cap_mb = options.renamed_args("recommended", {"cap_mb": cap_mb}, renamed,
                                  {"bucket_cap_mb": "cap_mb"})["cap_mb"]
    if plan is not None:
        cap = max((b.nbytes for b in plan.buckets), default=0)
        cap_mb = cap / (1024 * 1024)
    else:
        cap_mb = 25.0 if cap_mb is None else cap_mb
        cap = options.cap_bytes(cap_mb, "cap_mb")
    name = backend.lower()
    if name in _GPU:
        threshold = xla_options.combine_threshold(cap)
        if threshold is None:
            return Recommendation(
                {},
                "",
                (
                    f"GPU: {cap_mb:g} MiB buckets fit XLA's default all-reduce combine "
                    "threshold (30 MiB); no flags needed.",
                ),
            )
        mib = threshold // (1024 * 1024)
        return Recommendation(
            {"xla_gpu_all_reduce_combine_threshold_bytes": threshold},
            f"--xla_gpu_all_reduce_combine_threshold_bytes={threshold}",
            (
                f"GPU: buckets of up to {cap_mb:g} MiB exceed XLA's default all-reduce "
                f"combine threshold (30 MiB) and would each be split into several all-reduces; "
                f"a threshold of {mib} MiB keeps each bucket one all-reduce (jddp's chain still "
                "keeps buckets apart).",
            ),
        )
    if name in _OTHER:
        return Recommendation(
            {},
            "",
            (f"{name.upper()}: jddp's chain keeps one all-reduce per bucket; no flags needed.",),
        )
    raise ValueError(f"backend must be one of {_GPU + _OTHER}, got {backend!r}.")
