"""The step's program grows linearly with depth, like the ``jit`` + ``NamedSharding`` peer's.

The proxy is exact and cheap: HLO instructions of the lowered (StableHLO) and the compiled step,
per layer, at two depths. The buckets are kept at a fixed count (cap: a third of the model), so
that each bucket's leaf count grows with depth, as with the default plan on a deep model. A step
whose size has a term in the product of two buckets' leaf counts (XLA once duplicated the chain's
always-zero scalar, a sum over the previous bucket's leaves, into the fusion of every gradient of
the next bucket; see ``chain_dependency`` in jddp/_src/reduce/chain.py) fails here: on the MLP below
the compiled step had 344 instructions per layer at 16 layers and 408 at 32 (jit's: 132 and 130);
ZeRO-3 and accumulation failed too.
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jddp
from tests._models import layer_list_loss

DEPTHS = (16, 32)
WIDTH, BATCH, BUCKETS = 16, 32, 3
TOLERANCE = 0.10


def count_instructions(text: str) -> int:
    """Instructions of an HLO or StableHLO text: the lines that define a value."""
    return sum(1 for line in text.splitlines() if " = " in line)


def _model(depth: int) -> tuple[list, dict]:
    rng = np.random.default_rng(depth)
    params = [{"b": np.zeros((WIDTH,), np.float32),
               "w": (rng.normal(size=(WIDTH, WIDTH)) / WIDTH**0.5).astype(np.float32)}
              for _ in range(depth)]
    batch = {k: rng.normal(size=(BATCH, WIDTH)).astype(np.float32) for k in ("x", "y")}
    return params, batch


def _sizes(lowered: jax.stages.Lowered) -> tuple[int, int, str]:
    compiled = lowered.compile().as_text()
    return count_instructions(lowered.as_text()), count_instructions(compiled), compiled


@functools.cache
def peer_sizes(depth: int) -> tuple[int, int]:
    """(lowered, compiled) instructions of the jit + NamedSharding step (replicated params,
    batch split over the devices, XLA partitions it)."""
    params, batch = _model(depth)
    mesh = jddp.data_mesh()
    opt = optax.adam(1e-3)

    def step(p, o, b):
        loss, grads = jax.value_and_grad(layer_list_loss)(p, b)
        updates, o = opt.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    lowered = jax.jit(step).lower(jax.device_put(params, rep),
                                  jax.device_put(opt.init(params), rep),
                                  jax.device_put(batch, data))
    return _sizes(lowered)[:2]


VARIANTS = {
    "replicate": {},
    "zero3": {"place": jddp.ZeRO(stage=3)},
    "accumulate": {"accumulate": jddp.Accumulate(steps=2)},
}


def jddp_sizes(depth: int, variant: str) -> tuple[int, int, int, int]:
    """(lowered, compiled, buckets planned, all-reduces compiled) of jddp's step."""
    params, batch = _model(depth)
    mesh = jddp.data_mesh()
    mb = sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20
    ddp = jddp.DataParallel(layer_list_loss, optax.adam(1e-3), mesh=mesh,
                            reduce=jddp.Buckets(cap_mb=mb / BUCKETS, first_mb=mb / BUCKETS),
                            **VARIANTS[variant])
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    state = ddp.init(params)
    lowered, compiled, text = _sizes(ddp.step.lower(state, batch))
    buckets = ddp.plan(params, batch).num_buckets
    return lowered, compiled, buckets, len(re.findall(r"\ball-reduce\(", text))


@pytest.mark.parametrize("variant", [
    "replicate",
    pytest.param("zero3", marks=pytest.mark.slow),
    pytest.param("accumulate", marks=pytest.mark.slow),
])
def test_program_size_per_layer_is_constant_in_depth(variant):
    small, large = (jddp_sizes(d, variant) for d in DEPTHS)
    # The same bucket count at both depths: each bucket holds twice the leaves at the larger.
    assert small[2] == large[2] >= BUCKETS, (small, large)
    if variant == "replicate":  # the chain kept the buckets apart in the compiled program
        assert small[3] == large[3] == small[2], (small, large)
    peer = [peer_sizes(d) for d in DEPTHS]
    for k, what in enumerate(("lowered", "compiled")):
        per_layer = [small[k] / DEPTHS[0], large[k] / DEPTHS[1]]
        peer_per_layer = [peer[0][k] / DEPTHS[0], peer[1][k] / DEPTHS[1]]
        growth = per_layer[1] / per_layer[0]
        peer_growth = peer_per_layer[1] / peer_per_layer[0]
        msg = (f"{what} step, instructions per layer at {DEPTHS} layers: jddp {per_layer}, "
               f"jit + NamedSharding {peer_per_layer}")
        assert abs(growth - 1) <= TOLERANCE, msg
        assert abs(growth / peer_growth - 1) <= TOLERANCE, msg
