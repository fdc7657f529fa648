"""Exactly-once input across processes, resumes and layout changes (DDP's ``DistributedSampler``
without its duplicates).

A :class:`Loader` cuts a random-access source into global batches: the order is a function of
``(seed, epoch)`` only, each process reads only its rows, and a short last batch is filled with
real examples and masked (docs/data.md has the rules and why not grain's samplers). A background
thread reads ``prefetch`` batches ahead (host memory: ``prefetch + 2`` local batches);
``workers=n`` helps only sources whose reads release the GIL.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.runtime import mesh as mesh_lib

#: The ``format`` entry of a loader state; a state of another format is refused.
STATE_FORMAT = "jddp.data.Loader/1"


class ArraySource:
    """A random-access source over a pytree of arrays with the examples on the leading axis.

    ``source[i]`` is the tree of row ``i`` of every leaf; ``source.take(indices)`` reads many rows
    with one gather per leaf (the loader reads an ArraySource's batches that way).

    Args:
      arrays: e.g. ``{"image": x, "label": y}``; every leaf has the same leading dimension.
    """

    def __init__(self, arrays: Any) -> None:
        leaves = jax.tree.leaves(arrays)
        if not leaves:
            raise ValueError("ArraySource needs a pytree with at least one array leaf.")
        sizes = {np.shape(x)[0] if np.ndim(x) else -1 for x in leaves}
        if len(sizes) != 1 or -1 in sizes:
            raise ValueError(
                "ArraySource leaves must share a leading (example) dimension, got leading sizes "
                f"{sorted(sizes)} (-1: a scalar leaf)."
            )
        self.arrays = jax.tree.map(np.asarray, arrays)
        self._length = int(next(iter(sizes)))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        return jax.tree.map(lambda x: x[index], self.arrays)

    def take(self, indices: Any) -> Any:
        """The stacked rows ``indices`` of every leaf (one gather per leaf)."""
        idx = np.asarray(indices, np.int64)
        return jax.tree.map(lambda x: x[idx], self.arrays)


def check_source(source: Any) -> int:
    """``len(source)``, after checking it is a usable random-access source (clear errors)."""
    if isinstance(source, dict | tuple):
        raise TypeError(
            f"The loader's source is a {type(source).__name__}: a dict or tuple of arrays is not a "
            "sequence of examples. Wrap it: jddp.data.ArraySource(arrays) (examples on the "
            "leading axis of every array)."
        )
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise TypeError(
            f"The loader's source must be random-access: support len(source) and source[i] "
            f"(grain's RandomAccessDataSource protocol, a grain MapDataset, a list, "
            f"jddp.data.ArraySource), got {type(source).__name__}."
        )
    n = len(source)
    if n < 1:
        raise ValueError("The loader's source is empty (len(source) == 0).")
    return int(n)


def epoch_order(length: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The example indices of epoch ``epoch`` in visiting order: a function of its arguments only
    (never of the process or device count)."""
    if not shuffle:
        return np.arange(length, dtype=np.int64)
    return np.random.default_rng([int(seed), int(epoch)]).permutation(length).astype(np.int64)


class _Spec(NamedTuple):
    """The structure every example must have: the treedef and each leaf's shape and dtype."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]


def _spec_of(example: Any) -> _Spec:
    leaves, treedef = jax.tree.flatten(example)
    arrays = [np.asarray(x) for x in leaves]
    if not arrays:
        raise ValueError("An example of the source has no array leaves.")
    return _Spec(treedef, tuple(a.shape for a in arrays), tuple(a.dtype for a in arrays))


def _check_example(spec: _Spec, example: Any, index: int) -> list[np.ndarray]:
    leaves, treedef = jax.tree.flatten(example)
    if treedef != spec.treedef:
        raise ValueError(
            f"Example {index} of the source has structure {treedef}, but earlier examples have "
            f"{spec.treedef}. Every example must be the same pytree of arrays (same keys)."
        )
    arrays = [np.asarray(x) for x in leaves]
    for i, (a, shape, dtype) in enumerate(zip(arrays, spec.shapes, spec.dtypes, strict=True)):
        if a.shape != shape or a.dtype != dtype:
            raise ValueError(
                f"Example {index} of the source has leaf {i} of shape {a.shape} and dtype "
                f"{a.dtype}, but earlier examples have {shape} {dtype}. Every example must have "
                "the same shapes and dtypes (pad or crop variable-size examples in the source)."
            )
    return arrays


class HostBatch(NamedTuple):
    """One global batch as this process holds it on the host, before placement.

    Attributes:
      position: the batch's place in the stream (global batches since epoch 0, batch 0).
      leaves: this process's rows of every leaf, stacked in the order of ``Loader.local_rows``.
      real: the number of real examples in the whole global batch (the rest is padding).
    """

    position: int
    leaves: tuple[np.ndarray, ...]
    real: int


class WindowEnd:
    """:attr:`Loader.window_end`: a bool (``if loader.window_end``, ``== True``) that also
    carries the loader's ``accumulate_steps``, so that ``ddp.step(..., sync=loader.window_end)``
    can refuse a loader whose windows are not the step's ``Accumulate(steps=k)``.

    Attributes:
      value: whether the batch last handed out closes its window.
      accumulate_steps: the loader's window, in batches.
    """

    __slots__ = ("accumulate_steps", "value")

    def __init__(self, value: bool, accumulate_steps: int) -> None:
        self.value, self.accumulate_steps = bool(value), int(accumulate_steps)

    def __bool__(self) -> bool:
        return self.value

    def __eq__(self, other: object) -> bool:
        return self.value == (other.value if isinstance(other, WindowEnd) else other)

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


class Loader:
    """Global batches of a random-access source, each process reading only its rows.

    Iterating gives ``(batch, mask)`` forever, epoch after epoch ([Data](../data.md) has
    the order, the reads and the padding)::

        loader = jddp.data.Loader(source, global_batch_size=256, mesh=mesh, seed=0)
        loader.restore(saved)            # optional: continue after a saved state
        for step in range(num_steps):
            batch, mask = next(loader)   # mask None, or (B,) bool for the short last batch
            state, metrics = ddp.step(state, batch, mask=mask)  # Loss(weighted=True)

    Args:
      source: ``len(source)`` and ``source[i]`` (an example: a pytree of arrays, the same
        structure, shapes and dtypes for every ``i``); an :class:`ArraySource` is read a batch at
        a time.
      global_batch_size: examples per global batch, a multiple of the data-axis devices.
      mesh: the data mesh (default ``jddp.data_mesh()``); the batch is split over its ``"data"``
        axis, or both axes of a two-level mesh.
      seed: the shuffling seed; the order of epoch ``e`` depends on ``(seed, e)`` only.
      shuffle: shuffle every epoch (False: index order, e.g. for evaluation).
      drop_last: drop the short last batch of each epoch instead of padding it.
      prefetch: local batches read ahead by a background thread (0: read when asked).
      workers: threads that read a batch's examples (``source[i]``) in parallel.
      accumulate_steps: ``k`` for ``accumulate=jddp.Accumulate(steps=k)``: the stream is cut into
        windows of ``k`` consecutive batches; :attr:`window_end` says when to synchronise, and
        :meth:`state` refuses to save in the middle of a window.
    """

    def __init__(
        self, source: Any, *, global_batch_size: int, mesh: Mesh | None = None, seed: int = 0,
        shuffle: bool = True, drop_last: bool = False, prefetch: int = 2,
        accumulate_steps: int = 1, workers: int = 1,
    ) -> None:
        self.source = source
        self.length = check_source(source)
        self.mesh = mesh_lib.check_mesh(mesh_lib.data_mesh() if mesh is None else mesh)
        self.axis = mesh_lib.data_axis(self.mesh)
        devices = mesh_lib.axis_size(self.mesh, self.axis)
        for name, value in (("global_batch_size", global_batch_size), ("seed", seed),
                            ("prefetch", prefetch), ("accumulate_steps", accumulate_steps),
                            ("workers", workers)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise TypeError(f"{name} must be an int, got {value!r}.")
        if global_batch_size < 1 or global_batch_size % devices:
            lo = global_batch_size - global_batch_size % devices
            raise ValueError(
                f"global_batch_size={global_batch_size} does not divide over the {devices} "
                f"devices of the data axis {self.axis!r}: use a multiple of {devices} (e.g. "
                f"{lo or devices} or {lo + devices})."
            )
        if prefetch < 0 or accumulate_steps < 1 or workers < 1:
            raise ValueError(f"prefetch must be >= 0, accumulate_steps and workers >= 1, got "
                             f"{prefetch}, {accumulate_steps} and {workers}.")
        self.global_batch_size = int(global_batch_size)
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self.prefetch, self.accumulate_steps = int(prefetch), int(accumulate_steps)
        self._pool = ThreadPoolExecutor(int(workers), "jddp-data-read") if workers > 1 else None
        full, rest = divmod(self.length, self.global_batch_size)
        self._batches = full if (drop_last or not rest) else full + 1
        if self._batches == 0:
            raise ValueError(
                f"drop_last=True with {self.length} examples and global_batch_size="
                f"{self.global_batch_size}: not one full batch per epoch. Use a smaller batch or "
                "drop_last=False."
            )
        self.sharding = NamedSharding(self.mesh, P(self.axis))
        self.local_rows = mesh_lib.local_rows(self.sharding, self.global_batch_size)
        self._position = 0            # the next batch the caller gets
        self._spec: _Spec | None = None
        self._orders: dict[int, np.ndarray] = {}
        self._reader: _ReadAhead | None = None

    # ------------------------------------------------------------------ where the stream is
    def __len__(self) -> int:
        """Global batches per epoch (the short last one included unless ``drop_last``)."""
        return self._batches

    @property
    def position(self) -> int:
        """Global batches handed out since the start of the stream (epoch 0, batch 0)."""
        return self._position

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self._position // self._batches

    @property
    def window_end(self) -> WindowEnd:
        """True when the batch last handed out closes its accumulation window (sync on it); a
        :class:`WindowEnd`, which the step checks against its ``Accumulate.steps``."""
        return WindowEnd(self._position % self.accumulate_steps == 0, self.accumulate_steps)

    def indices(self, position: int) -> tuple[np.ndarray, int]:
        """The example indices of the global batch at ``position`` (its real rows) and the count
        of real rows; the same on every process and layout."""
        rows, real = self.rows(position)
        return rows[:real], real

    def rows(self, position: int) -> tuple[np.ndarray, int]:
        """The example indices of all ``global_batch_size`` rows of the batch at ``position``:
        its real rows, then (a short last batch) the padding, which wraps around to the start of
        the same epoch's order (``DistributedSampler``'s padding); and the count of real rows."""
        epoch, b = divmod(int(position), self._batches)
        order = self._order(epoch)
        real = order[b * self.global_batch_size:(b + 1) * self.global_batch_size]
        # np.resize repeats the order cyclically: an epoch shorter than the padding wraps again.
        pad = np.resize(order, self.global_batch_size - len(real))
        return np.concatenate([real, pad]), len(real)

    def _order(self, epoch: int) -> np.ndarray:
        orders = self._orders  # the read-ahead thread calls this too: read once, swap whole
        if epoch not in orders:
            orders = {epoch: epoch_order(self.length, self.seed, epoch, self.shuffle)}
            self._orders = orders
        return orders[epoch]

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """Where the stream is, as a small JSON-serialisable dict (:meth:`restore` takes it)."""
        inside = self._position % self.accumulate_steps
        if inside:
            raise RuntimeError(
                f"Loader state asked for in the middle of an accumulation window ({inside} of "
                f"{self.accumulate_steps} micro-batches handed out). "
                "Save at window boundaries (after the synchronising step: loader.window_end), so "
                "that the saved TrainState and loader agree."
            )
        epoch, batch = divmod(self._position, self._batches)
        return {"format": STATE_FORMAT, "position": self._position, "epoch": epoch,
                "batch": batch, **self.state_config()}

    def restore(self, state: dict[str, Any]) -> None:
        """Continues at the batch after the one ``state`` was taken at, on any layout.

        Raises:
          ValueError: ``state`` belongs to another data set or loader configuration (length,
            seed, shuffle, drop_last, global batch size), or is not a loader state.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"Not a jddp.data.Loader state (format {STATE_FORMAT!r}): {state!r}")
        mine = self.state_config()
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            desc = ", ".join(f"{k}: saved {a!r}, this loader {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"The loader state was saved for another data set or loader ({desc}). Restore it "
                "on a loader over the same source with the same seed, shuffle, drop_last and "
                "global_batch_size, or start this one from the beginning."
            )
        position = int(state["position"])
        if position < 0 or position % self.accumulate_steps:
            raise ValueError(f"Loader state position {position} is not at a window boundary of "
                             f"accumulate_steps={self.accumulate_steps}.")
        self._stop_reader()
        self._position = position

    def state_config(self) -> dict[str, Any]:
        """What a state must match to be restored here (the data set and the batching)."""
        return {"length": self.length, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "global_batch_size": self.global_batch_size}

    # ------------------------------------------------------------------ reading
    def read(self, position: int) -> HostBatch:
        """This process's rows of the global batch at ``position``, read and stacked on the host.
        """
        rows, real = self.rows(position)
        flat = np.concatenate([rows[a:b] for a, b in self.local_rows])
        _, leaves = self._read_rows(flat)
        return HostBatch(int(position), tuple(leaves), real)

    @property
    def local_size(self) -> int:
        """Rows of each global batch this process holds."""
        return sum(stop - start for start, stop in self.local_rows)

    def _read_rows(self, indices: np.ndarray) -> tuple[_Spec, list[np.ndarray]]:
        if isinstance(self.source, ArraySource):
            stacked = self.source.take(indices)
            spec = self._spec or _spec_of(jax.tree.map(lambda x: np.asarray(x)[0], stacked))
            arrays = _check_example(
                _Spec(spec.treedef, tuple((len(indices),) + s for s in spec.shapes), spec.dtypes),
                stacked, int(indices[0]))
        else:
            read = self._pool.map if self._pool is not None else map
            examples = []
            got = read(self.source.__getitem__, map(int, indices))
            for i, example in zip(indices, got, strict=True):
                if self._spec is None:
                    self._spec = _spec_of(example)
                examples.append(_check_example(self._spec, example, int(i)))
            # Every process holds at least one row, all of them real examples: a spec was read.
            assert self._spec is not None
            spec = self._spec
            arrays = [np.stack([e[j] for e in examples]) for j in range(len(spec.shapes))]
        self._spec = spec
        return spec, arrays

    def place(self, host: HostBatch) -> tuple[Any, jax.Array | None]:
        """The global ``(batch, mask)`` of a host batch: this process's rows on its devices."""
        assert self._spec is not None
        starts = {}
        offset = 0
        for start, stop in self.local_rows:
            starts[start] = offset
            offset += stop - start
        b = self.global_batch_size

        def make(x: np.ndarray) -> jax.Array:
            def rows(index: Any) -> np.ndarray:
                start, stop, _ = index[0].indices(b)
                at = starts[start]
                return x[(slice(at, at + stop - start),) + tuple(index[1:])]
            return jax.make_array_from_callback((b,) + x.shape[1:], self.sharding, rows)

        batch = jax.tree.unflatten(self._spec.treedef, [make(x) for x in host.leaves])
        if host.real == b:
            return batch, None
        real = np.zeros(self.local_size, bool)
        for start, stop in self.local_rows:
            n = max(0, min(stop, host.real) - start)
            real[starts[start]:starts[start] + n] = True
        return batch, make(real)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[tuple[Any, jax.Array | None]]:
        return self

    def __next__(self) -> tuple[Any, jax.Array | None]:
        if self.prefetch == 0:
            host = self.read(self._position)
        else:
            if self._reader is None:
                self._reader = _ReadAhead(self, self._position)
            try:
                host = self._reader.get()
            except BaseException:
                self._reader = None  # stopped; the next call starts over at this position
                raise
            assert host.position == self._position
        self._position += 1
        return self.place(host)

    def _stop_reader(self) -> None:
        if self._reader is not None:
            self._reader.stop()
            self._reader = None

    def close(self) -> None:
        """Stops the read-ahead thread and the read workers (they also end with the process)."""
        self._stop_reader()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def __repr__(self) -> str:
        return (f"Loader({self.length} examples, global_batch_size={self.global_batch_size}, "
                f"{len(self)} batches/epoch, position {self._position}, seed={self.seed}, "
                f"shuffle={self.shuffle}, drop_last={self.drop_last})")


class _ReadAhead:
    """A daemon thread reading the loader's batches from ``position`` on into a bounded queue."""

    def __init__(self, loader: Loader, position: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=loader.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(loader, position), daemon=True,
                                        name="jddp-data-read-ahead")
        self._thread.start()

    def _run(self, loader: Loader, position: int) -> None:
        while not self._stop.is_set():
            try:
                item: Any = loader.read(position)
            except BaseException as e:  # handed to the consumer, which raises it
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            position += 1

    def get(self) -> HostBatch:
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.stop()
            raise item
        return item

    def stop(self) -> None:
        self._stop.set()
        while True:  # unblock a put() in progress
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5.0)
