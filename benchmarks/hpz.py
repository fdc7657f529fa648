"""ZeRO++'s hpZ (``reshard_after_forward=k``) against ``True`` and ``False`` at stage 3: the
compiled peak per device, ``comm_bytes`` and ``comm_bytes_hosts`` (each equal to the compiled
program's ring bytes), on 8 simulated CPU devices as 2 hosts x 4 (compile and one step; nothing
is timed).

Model: 8 square layers of 256 (tanh), one layer per bucket, Adam (P = 2.01 MiB); the model of
tests/test_hpz.py. Peak is ``arguments + outputs - aliased + temporaries``, in MiB.

    python benchmarks/hpz.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jddp  # noqa: E402
from jddp.perf.traffic import traffic  # noqa: E402

LAYERS, WIDTH = 8, 256


def model():
    rng = np.random.default_rng(3)
    params = {f"l{i}": {"w": jnp.asarray(rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH),
                                         jnp.float32),
                        "b": jnp.zeros((WIDTH,), jnp.float32)} for i in range(LAYERS)}

    def loss(p, b):
        h = b["x"]
        for i in range(LAYERS):
            h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return jnp.mean((h - b["y"]) ** 2)

    batch = {k: jnp.asarray(rng.standard_normal((32, WIDTH)), jnp.float32) for k in ("x", "y")}
    return params, loss, batch


def main() -> None:
    params, loss, batch = model()
    mb = WIDTH * (WIDTH + 1) * 4 / 2**20
    mesh = jddp.data_mesh(hosts=2)
    print("reshard_after_forward | peak MiB | temporaries MiB | comm_bytes | comm_bytes_hosts | "
          "program's bytes across / host")
    for reshard in (False, True, 4, 2):
        ddp = jddp.DataParallel(loss, optax.adam(1e-3), mesh=mesh,
                                reduce=jddp.Buckets(cap_mb=mb, first_mb=mb),
                                place=jddp.ZeRO(stage=3, reshard_after_forward=reshard),
                                donate=False)
        state = ddp.init(params)
        compiled = ddp.step.lower(state, batch).compile()
        _, m = compiled(state, batch, None, None)
        mem = compiled.memory_analysis()
        peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                + mem.temp_size_in_bytes)
        across = traffic(compiled.as_text(), jddp.mesh.host_of_device(mesh)).across
        print(f"{reshard!s:>21} | {peak / 2**20:8.3f} | {mem.temp_size_in_bytes / 2**20:15.3f} | "
              f"{float(m['comm_bytes']):10,.0f} | {float(m['comm_bytes_hosts']):16,.0f} | "
              f"{across:,.0f}")


if __name__ == "__main__":
    main()
