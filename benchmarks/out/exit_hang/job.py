"""One host scalar through JAX's process_allgather, then exit (the job that hangs at exit)."""
import numpy as np

import jddp.distributed as dist

dist.initialize(timeout_s=60)
import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

total = int(multihost_utils.process_allgather(np.int32(jax.process_index() + 1)).sum())
print(f"SUM={total}", flush=True)
