"""On CPU the default hook divides by the replica count after the sum where that gives the same
bits, so the scale fuses into the optimizer's update instead of taking a pass of its own over
each gradient before the all-reduce (benchmarks/out/cpu_step/README.md)."""

import _models
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jddp
from jddp._src.introspect import hlo

WIDTH, LAYERS = 256, 4
KERNEL = f"f32[{WIDTH},{WIDTH}]"


def _setup(n=8, seed=0):
    mesh = jddp.data_mesh(jax.devices()[:n])
    rng = np.random.default_rng(seed)
    params = [{"b": jnp.asarray(rng.normal(size=(WIDTH,)) * 0.1, jnp.float32),
               "w": jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / 16, jnp.float32)}
              for _ in range(LAYERS)]
    batch = {"x": rng.normal(size=(8 * n, WIDTH)).astype(np.float32),
             "y": rng.normal(size=(8 * n, WIDTH)).astype(np.float32)}
    return mesh, params, batch


def _ddp(mesh, **kw):
    # One layer per bucket (a 256 KiB kernel and its bias): four buckets, three chain links.
    kw.setdefault("cap_mb", 0.2)
    kw.setdefault("first_mb", 0.2)
    return jddp.DataParallel(_models.layer_list_loss, optax.sgd(0.1, momentum=0.9), mesh=mesh,
                             reduce=jddp.Buckets(**kw))


def _module(ddp, params, batch):
    return hlo.read_module(ddp.lower(params, batch).compile())


def _is_constant(ins, value):
    """Whether ``ins`` is a scalar constant equal to ``value`` in float32."""
    if ins.opcode != "constant" or ins.shape != "f32[]" or len(ins.operands) != 1:
        return False
    return np.float32(float(ins.operands[0])) == np.float32(value)


@pytest.mark.parametrize("n", [8, 6])
def test_mean_divides_after_the_sum_only_where_exact(n):
    """On 8 replicas the all-reduce takes the gradients as computed (the 1/8 fuses into the
    update), bit-equal to DDP's divide-first order; on 6 the default divides first, as DDP."""
    mesh, params, batch = _setup(n)

    def divide_first(grads, state, ctx):
        scale = 1.0 / ctx.axis_size
        return lax.psum(tuple(g * jnp.asarray(scale, g.dtype) for g in grads),
                        ctx.axis_name), state

    ddp = _ddp(mesh)
    first = _ddp(mesh, hook=jddp.hooks.CommHook(lambda leaf: (), divide_first, "divide_first",
                                               fuses_extras=True))
    # Without the chain (whose zero, computed from the previous bucket's results, also reads
    # them scaled), the all-reduce's operands show what is done to the gradients before it.
    module = _module(_ddp(mesh, chain="none"), params, batch)
    operands = {o for c in module.computation() if c.opcode == "all-reduce" for o in c.operands}
    entry = {i.name: i for i in module.computation()}
    kernel_operands = [entry[o] for o in operands if entry[o].shape.startswith(KERNEL)]
    assert len(kernel_operands) == LAYERS
    scaled = [i for i in kernel_operands if i.opcode == "fusion" and any(
        _is_constant(j, 1.0 / n) for c in module.reachable(i.calls)
        for j in module.computation(c))]
    assert len(scaled) == (0 if n == 8 else LAYERS)
    assert all(i.opcode == "dot" for i in kernel_operands) is (n == 8)
    s1, s2 = ddp.init(params), first.init(params)
    for _ in range(3):
        s1, m1 = ddp.step(s1, batch)
        s2, m2 = first.step(s2, batch)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(m1["loss"]) == float(m2["loss"])
