"""Performance tooling for jddp: predicting, measuring and inspecting a data-parallel step.

Nothing here is needed to train; the training API is the top of ``jddp``. This subpackage holds
what helps choose a configuration and check what XLA made of it:

- :mod:`jddp.perf.costmodel`: a pure alpha-beta cost model of one data-parallel iteration
  (``ModelProfile``, ``ClusterSpec``, ``Link``, ``simulate_iteration``) and the bucket-size
  advisor built on it (``advise_bucket_cap``, ``suggest_bucket_cap``).
- :mod:`jddp.perf.calibrate`: measures the cost model's inputs on the current machine (a step's
  compute per gradient leaf, an alpha-beta fit of all-reduce times) and the alternated timing
  loop the benchmarks use.
- :mod:`jddp.perf.profiles`: gradient profiles of reference models (ResNet-50, BERT-large), built
  from their architectures, for predictions without the model.
- :mod:`jddp.perf.schedule`: the reader of compiled XLA (HLO) text: the scheduled order of a
  computation, its collectives (all-reduce, all-gather, reduce-scatter, ... with their bytes,
  replica groups and position) and how much backward compute overlaps them.
- :mod:`jddp.perf.xla_flags`: the XLA options that keep a bucket plan intact, per backend.
- :mod:`jddp.perf.profile`: where a real step's time goes: host dispatch, device time, and a
  ``jax.profiler`` trace with each bucket's collectives named and timed.
- :mod:`jddp.perf.topologies`: compile-only GPU and TPU meshes, to compile (not run) a step for
  hardware this machine does not have.

The modules are imported explicitly, e.g. ``from jddp.perf import costmodel``; importing
``jddp.perf`` alone imports none of them.
"""
