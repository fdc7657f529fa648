"""Test set-up: 8 simulated CPU devices, before JAX initialises its backend."""

import chex

chex.set_n_cpu_devices(8)
