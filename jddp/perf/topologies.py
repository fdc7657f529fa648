"""Compile-only GPU and TPU meshes, for reading XLA's real schedules on a CPU-only machine.

Needs the backend's compiler plugin, and nothing else (no GPU, no CUDA libraries, no TPU)::

    pip install "jax[cuda13-local]==$JAX_VERSION"   # GPU: jax-cuda13-plugin, -pjrt
    pip install "jax[tpu]==$JAX_VERSION"            # TPU: libtpu
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "CUDA_PLUGIN_MODULES",
    "abstract_like",
    "gpu_mesh",
    "has_gpu_compiler",
    "has_tpu_compiler",
    "h100_target_config",
    "tpu_mesh",
]

#: Module names under which the CUDA PJRT plugins register with JAX, newest first.
CUDA_PLUGIN_MODULES = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")

_SKIP_ENV = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
_MULTIPLE_LIBTPU_ENV = "ALLOW_MULTIPLE_LIBTPU_LOAD"


def _pip_gpu() -> str:
    return f'pip install "jax[cuda13-local]=={jax.__version__}"'


def _pip_tpu() -> str:
    return f'pip install "jax[tpu]=={jax.__version__}"'


def has_gpu_compiler() -> bool:
    """True if a CUDA compiler plugin is installed (checked without initialising JAX)."""
    return any(_find_spec(m) for m in CUDA_PLUGIN_MODULES)


def has_tpu_compiler() -> bool:
    """True if libtpu is installed (checked without initialising JAX)."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    return bool(path and os.path.isfile(path)) or _find_spec("libtpu")


def h100_target_config() -> str:
    """The device description of an NVIDIA H100 SXM (80 GB) shipped with jddp, as text."""
    return resources.files("jddp.perf").joinpath("data/h100_sxm.txtpb").read_text()


def gpu_mesh(
    n: int = 8,
    *,
    target_config: str | os.PathLike[str] | None = None,
    axis_name: str = "data",
    hosts: int = 1,
) -> Mesh:
    """A 1-D mesh of ``n`` compile-only NVIDIA GPUs.

    Args:
        n: number of GPUs in all.
        target_config: the GPU description (an XLA ``GpuTargetConfigProto`` in text format):
            its text, or the path of a file holding it. Default: an H100 SXM
            (:func:`h100_target_config`).
        axis_name: name of the mesh axis.
        hosts: number of hosts the ``n`` GPUs are spread over (topology ``1 x hosts x n/hosts``);
            devices of host ``h`` have ``process_index == h``.

    Returns:
        A ``Mesh`` over the compile-only devices. Use it with abstract inputs
        (:func:`abstract_like`) and ``.lower(...).compile()``; nothing can run on it.

    Raises:
        ModuleNotFoundError: if no CUDA compiler plugin is installed (the message says what to
            install).
        ValueError: if ``n`` is not a positive multiple of ``hosts``.
    """
    if n < 1 or hosts < 1 or n % hosts:
        raise ValueError(f"need n a positive multiple of hosts, got n={n}, hosts={hosts}")
    if not has_gpu_compiler():
        raise ModuleNotFoundError(
            "gpu_mesh needs the CUDA compiler plugin for JAX (package jax-cuda13-plugin, with "
            f"jax-cuda13-pjrt); install it with: {_pip_gpu()}  (no GPU or CUDA libraries needed)",
            name="jax_plugins.xla_cuda13",
        )
    config = _read_target_config(target_config)
    # Must be set before JAX first initialises its backends: the plugin checks it then.
    os.environ.setdefault(_SKIP_ENV, "1")
    from jax.experimental import topologies

    topology = f"1x{hosts}x{n // hosts}"
    try:
        desc = topologies.get_topology_desc(
            platform="cuda", target_config=config, topology=topology
        )
    except NotImplementedError:
        # The plugin ran its version check earlier in this process without the variable set,
        # failed and did not register. Register it again now that the check is skipped.
        if not _reinitialise_cuda_plugin():
            raise
        desc = topologies.get_topology_desc(
            platform="cuda", target_config=config, topology=topology
        )
    return Mesh(np.array(desc.devices), (axis_name,))


def tpu_mesh(topology: str = "v5e:2x4", *, axis_name: str = "data") -> Mesh:
    """A 1-D mesh over every chip of a compile-only TPU topology.

    Args:
        topology: a TPU topology name such as ``"v5e:2x4"`` (8 chips on 2 hosts), ``"v5e:4x4"``
            (16 chips, 4 hosts), ``"v5e:2x2"`` (one host), ``"v4:2x2x1"``, ``"v6e:2x4"``.
            Multi-host topologies give devices with several ``process_index`` values: the
            program compiled on them is the one each host of that slice would run.
        axis_name: name of the mesh axis.

    Returns:
        A ``Mesh`` over the compile-only TPU devices.

    Raises:
        ModuleNotFoundError: if libtpu is not installed (the message says what to install).
    """
    if not has_tpu_compiler():
        raise ModuleNotFoundError(
            f"tpu_mesh needs libtpu (the TPU compiler); install it with: {_pip_tpu()}  "
            "(no TPU needed)",
            name="libtpu",
        )
    # With libtpu installed, every JAX process that initialises its backends (even a CPU-only
    # one) holds /tmp/libtpu_lockfile while it lives, and libtpu then refuses to start in any
    # other process ("Internal error when accessing libtpu multi-process lockfile"). Compiling
    # needs no TPU, so allow the concurrent load; read when libtpu initialises in this process.
    os.environ.setdefault(_MULTIPLE_LIBTPU_ENV, "1")
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    return Mesh(np.array(desc.devices), (axis_name,))


def abstract_like(tree: Any, mesh: Mesh, spec: Any = None) -> Any:
    """``jax.ShapeDtypeStruct`` leaves with ``NamedSharding``s, for lowering without data.

    Args:
        tree: a pytree whose leaves have ``shape`` and ``dtype`` (arrays, ``ShapeDtypeStruct``s,
            NumPy arrays; Python scalars are taken as NumPy scalars).
        mesh: the mesh the shardings refer to, e.g. from :func:`gpu_mesh`.
        spec: a ``PartitionSpec`` for every leaf, or a pytree of ``PartitionSpec``s that is a
            prefix of ``tree``. Default ``PartitionSpec()`` (replicated).

    Returns:
        A pytree of the same structure with ``ShapeDtypeStruct(shape, dtype, sharding=...)``
        leaves.
    """
    if spec is None:
        spec = PartitionSpec()

    def one(s: PartitionSpec) -> Callable[[Any], jax.ShapeDtypeStruct]:
        sharding = NamedSharding(mesh, s)

        def leaf(x: Any) -> jax.ShapeDtypeStruct:
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                x = np.asarray(x)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        return leaf

    if isinstance(spec, PartitionSpec):
        return jax.tree.map(one(spec), tree)
    # A tree of specs: each spec applies to the whole subtree at its position.
    return jax.tree.map(
        lambda s, sub: jax.tree.map(one(s), sub),
        spec,
        tree,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def _read_target_config(target_config: str | os.PathLike[str] | None) -> str:
    if target_config is None:
        return h100_target_config()
    if isinstance(target_config, os.PathLike):
        return Path(target_config).read_text()
    # The proto text always has a brace; a string without one is taken as a path.
    if "{" not in target_config:
        return Path(target_config).read_text()
    return target_config


def _find_spec(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _reinitialise_cuda_plugin() -> bool:
    for name in CUDA_PLUGIN_MODULES:
        if not _find_spec(name):
            continue
        plugin = importlib.import_module(name)
        plugin.initialize()
        return True
    return False


def mark_host_arguments(lowered: jax.stages.Lowered, indices: Any) -> jax.stages.Lowered:
    """``lowered`` with its flat arguments at ``indices`` placed in pinned host memory.

    Compile-only devices have no memory spaces, so JAX drops a ``NamedSharding``'s
    ``memory_kind`` on them (``jddp.ZeRO(offload=True)``'s optimizer state then lowers as a
    device argument); the transfers inside the step (``jax.device_put`` to a
    ``jax.memory.Space``) survive. This writes the missing ``mhlo.memory_kind = "pinned_host"``
    on those arguments of the lowered module, as JAX does for devices that have host memory, so
    ``.compile()`` gives the program a real GPU would run. Call before the first ``compile``.

    Args:
        lowered: a ``jax.stages.Lowered`` whose arguments were not pruned (one per leaf).
        indices: positions among ``jax.tree.leaves`` of the lowered call's arguments.
    """
    from jaxlib.mlir import ir

    module: Any = lowered.compiler_ir("stablehlo")
    if module is None:
        raise ValueError("mark_host_arguments needs a lowering with a StableHLO module")
    with module.context:
        main = next(op for op in module.body.operations
                    if "sym_name" in op.attributes
                    and ir.StringAttr(op.attributes["sym_name"]).value == "main")
        attrs = list(main.arg_attrs)
        for i in indices:
            entries = {a.name: a.attr for a in ir.DictAttr(attrs[i])}  # type: ignore[attr-defined]
            entries["mhlo.memory_kind"] = ir.StringAttr.get("pinned_host")
            attrs[i] = ir.DictAttr.get(entries)
        main.arg_attrs = ir.ArrayAttr.get(attrs)
    return lowered
