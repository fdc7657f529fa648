"""The program check across processes (``jddp._src.step.programs``): processes that compiled
different step programs get ``jddp.ProgramMismatchError`` on every process, naming the processes
and the first differing collective, before any collective runs (no Gloo abort, no hang)."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest

from jddp._src.introspect import hlo
from jddp._src.step import programs
from jddp.launch import free_port
from tests.launch_util import REPO, child_env, run_launcher

# One job runs every scenario in turn: a mismatch runs nothing, so the job stays usable.
SCRIPT = r'''
import sys, time
import numpy as np
import jax
import jddp
if len(sys.argv) > 1:  # without jddp-run: jddp.initialize's own arguments
    jddp.initialize(sys.argv[1], 2, int(sys.argv[2]), local_device_count=4, timeout_s=60)
    only = sys.argv[3]
else:
    only = None
    jddp.initialize(timeout_s=60)
import jax.numpy as jnp
import optax
from jddp._src.step import programs

me = jax.process_index()
mesh = jddp.data_mesh()
assert mesh.size == 8 and jax.process_count() == 2
rng = np.random.default_rng(0)
params = {f"d{i}": {"w": (rng.normal(size=(16, 16)) / 4).astype(np.float32),
                    "b": np.zeros((16,), np.float32)} for i in range(3)}
params["scale"] = np.ones((16,), np.float32)
local = rng.normal(size=(8, 16)).astype(np.float32)
batch = jddp.distributed.global_batch_from_local({"x": local + (1.0 if me == 0 else -1.0),
                                      "y": local}, mesh)

def mlp(order, use_scale=False):
    def loss_fn(p, b):
        x = b["x"]
        for i in order:
            x = jnp.tanh(x @ p[f"d{i}"]["w"] + p[f"d{i}"]["b"])
        if use_scale:
            x = x * p["scale"]
        return jnp.mean((x - b["y"]) ** 2)
    return loss_fn

# A data-dependent branch: whether the loss uses "scale" depends on this process's own data.
use_scale = float(local.mean() + (1.0 if me == 0 else -1.0)) > 0
cases = {
    "caps": (mlp((0, 1, 2)), {"cap_mb": 25.0 if me == 0 else 0.001}),
    "model": (mlp((0, 1, 2) if me == 0 else (0, 2, 1)), {"cap_mb": 0.001}),
    "branch": (mlp((0, 1, 2), use_scale), {"cap_mb": 0.001}),
}
for name, (loss_fn, kw) in cases.items():
    if only is not None and name != only:
        continue
    ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh,
                            reduce=jddp.Buckets(first_mb=0.0005, **kw))
    state = ddp.init(params)
    t = time.perf_counter()
    try:
        state, _ = ddp.step(state, batch)
        jax.block_until_ready(state)
        print("NO ERROR", name, flush=True)
    except programs.ProgramMismatchError as e:
        assert isinstance(e, jddp.ProgramMismatchError)
        print(f"MISMATCH {name} {time.perf_counter() - t:.2f}s differing={list(e.differing)} "
              f"index={e.index} :: {e}", flush=True)

# The same program on both: it runs, once checked, and the check's cost is printed. The happy
# path compares fingerprints only: nothing reads the program's collectives.
costs = []
parsed = []
check, sign, describe = programs.check_across_processes, programs.signature, programs.describe
programs.describe = lambda *a, **k: parsed.append(1) or describe(*a, **k)
def timed(fn):
    def run(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        costs.append(time.perf_counter() - t)
        return out
    return run
programs.check_across_processes, programs.signature = timed(check), timed(sign)
ddp = jddp.DataParallel(mlp((0, 1, 2)), optax.sgd(0.1), mesh=mesh,
                        reduce=jddp.Buckets(cap_mb=0.001, first_mb=0.0005))
state = ddp.init(params)
for _ in range(3):
    state, metrics = ddp.step(state, batch)
print(f"AGREE loss={float(metrics['loss']):.6f} checks={len(costs) // 2} "
      f"cost_ms={1000 * sum(costs):.1f} cache={ddp.step.cache_size()} parsed={len(parsed)}",
      flush=True)
'''


def _mismatches(out: str) -> dict[tuple[int, str], str]:
    found = {}
    for line in out.splitlines():
        m = re.match(r"(?:\[rank(\d)\] )?MISMATCH (\w+) ([\d.]+)s (.*)", line)
        if m:
            found[(int(m.group(1) or -1), m.group(2))] = line
            assert float(m.group(3)) < 30.0, line
    return found


@pytest.mark.slow
def test_mismatched_programs_raise_a_named_error_on_every_process(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    rc, out, err, _ = run_launcher(["-n", "2", "--devices-per-process", "4", str(script)],
                                   timeout=240)
    assert rc == 0, (out[-3000:], err[-3000:])
    found = _mismatches(out)
    for rank in (0, 1):
        caps = found[(rank, "caps")]
        # Cap 25 MiB: the first bucket and one more; cap 1 KiB: a bucket per layer.
        assert "differing=[1] index=1" in caps and "process(es) [1] differ" in caps, caps
        assert re.search(r"process 0 has all-reduce of 2180 bytes .* for bucket 1 .*; process 1 "
                         r"has all-reduce of 1088 bytes", caps), caps
        model = found[(rank, "model")]
        # Swapped layers of equal shapes: the collectives agree, the buckets do not.
        assert "index=None" in model and "buckets hold different parameters" in model, model
        assert "d2.w" in model and "d1.w" in model, model
        branch = found[(rank, "branch")]
        assert "differing=[1]" in branch and "bucket" in branch, branch
        assert f"[rank{rank}] AGREE" in out and f"[rank{rank}] NO ERROR" not in out
    agree = re.findall(r"AGREE loss=(\S+) checks=(\d+) cost_ms=(\S+) cache=(\d+) parsed=(\d+)",
                       out)
    assert len(agree) == 2 and agree[0][0] == agree[1][0], agree
    assert all(int(c) == 1 and int(k) == 1 for _, c, _, k, _ in agree), agree  # once per program
    # Equal fingerprints on both processes: the program was not parsed.
    assert all(int(p) == 0 for *_, p in agree), agree
    print("program check cost (ms) per process:", [float(x[2]) for x in agree])


@pytest.mark.slow
def test_program_check_with_initialize_alone(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), address, str(i), "caps"], cwd=REPO,
                              env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, (out[-2000:], err[-3000:])
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for out in outs:
        found = _mismatches(out)
        assert {name for _, name in found} == {"caps"}, out
        assert "AGREE" in out


def test_signature_and_message_name_the_first_difference():
    a = programs.ProgramSignature(
        (programs.CollectiveSig("all-reduce", ("f32[16,16]", "f32[16]"), 1088, 8, "{}", "", 0),),
        (("d2.b", "d2.w"),))
    b = programs.ProgramSignature(
        (programs.CollectiveSig("all-reduce", ("f32[16]",), 64, 8, "{}", "loop", 0),),
        (("d2.b",), ("d2.w",)))
    assert programs.ProgramSignature.from_json(a.to_json()) == a
    assert a.digest() != b.digest() and a.digest() == programs.ProgramSignature.from_json(
        a.to_json()).digest()
    err = programs.describe_mismatch(a, b, 1, [1], 2)
    assert err.differing == (1,) and err.index == 0
    msg = str(err)
    assert "process 0 has all-reduce of 1088 bytes (f32[16,16], f32[16]) for bucket 0" in msg, msg
    assert "process 1 has all-reduce of 64 bytes (f32[16]) for bucket 0 over groups of 8, in a loop" \
        in msg, msg
    assert "bucket 0 holds ['d2.b', 'd2.w'] on process 0 and ['d2.b'] on process 1" in msg, msg


class _FakeClient:
    """The key-value calls of jax.distributed's client, in memory, shared by threads."""

    def __init__(self, n: int) -> None:
        import threading

        self.kv: dict[str, str] = {}
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(n)

    def key_value_set(self, key, value):
        with self.lock:
            self.kv[key] = value

    def key_value_dir_get(self, prefix):
        with self.lock:
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def blocking_key_value_get(self, key, timeout_ms):
        import time

        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            with self.lock:
                if key in self.kv:
                    return self.kv[key]
            if time.monotonic() > deadline:
                raise TimeoutError(f"DEADLINE_EXCEEDED waiting for {key}")
            time.sleep(0.005)

    def wait_at_barrier(self, name, timeout_ms):
        self.barrier.wait(timeout_ms / 1000)


def _run(sigs, limit=5.0, present=None):
    """Runs the exchange of each process in a thread; returns each one's exception or None."""
    import threading

    n = len(sigs)
    client = _FakeClient(n)
    out: list = [None] * n

    def one(p):
        try:
            programs.exchange(client, sigs[p], 0, p, n, limit)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[p] = e

    threads = [threading.Thread(target=one, args=(p,)) for p in (present or range(n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_exchange_names_the_differing_processes_and_the_missing_ones():
    a = programs.ProgramSignature(
        (programs.CollectiveSig("all-reduce", ("f32[16]",), 64, 3, "{}", "", 0),), (("b",),))
    b = a._replace(collectives=(a.collectives[0]._replace(operands=("bf16[16]",), nbytes=32),))
    assert _run([a, a, a]) == [None, None, None]
    errs = _run([a, b, b])
    assert all(isinstance(e, programs.ProgramMismatchError) for e in errs)
    assert all(e.differing == (1, 2) and e.index == 0 for e in errs)
    assert "process 1 has all-reduce of 32 bytes (bf16[16])" in str(errs[0])
    # Process 2 never arrives (it compiled fewer programs): the others name it.
    errs = _run([a, a, a], limit=0.5, present=[0, 1])
    assert all(isinstance(e, programs.ProgramMismatchError) for e in errs[:2])
    assert "Process(es) [2] did not reach the check" in str(errs[0]) and errs[0].differing == (2,)


MISSING = r'''
import os, time
os.environ["JDDP_PROGRAM_CHECK_TIMEOUT"] = "2"
import jax, jddp
jddp.initialize(timeout_s=60)
from jddp._src.step import programs
sig = programs.ProgramSignature((), ())
if jax.process_index() == 1:
    time.sleep(4)  # arrives after process 0 stopped waiting
t = time.perf_counter()
try:
    programs.check_across_processes(sig)
except programs.ProgramMismatchError as e:
    print(f"LATE {time.perf_counter() - t:.1f}s {e}", flush=True)
if jax.process_index() == 0:
    time.sleep(5)  # process 0 holds the coordinator: let process 1 come and report first
# After a failed barrier JAX's shutdown waits out its timeout; a mismatch uncaught leaves with
# os._exit (jddp.initialize's excepthook) anyway.
jddp.distributed.hard_exit(0)
'''


@pytest.mark.slow
def test_a_process_that_never_arrives_is_named_and_the_late_one_told(tmp_path):
    script = tmp_path / "missing.py"
    script.write_text(MISSING)
    rc, out, err, _ = run_launcher(["-n", "2", "--devices-per-process", "1", str(script)],
                                   timeout=90)
    assert rc == 0, (out[-2000:], err[-2000:])
    zero = next(x for x in out.splitlines() if x.startswith("[rank0] LATE"))
    one = next(x for x in out.splitlines() if x.startswith("[rank1] LATE"))
    assert "Process(es) [1] did not reach the check" in zero, zero
    assert float(zero.split()[2][:-1]) < 10, zero
    assert "this process (#1) reached it after the others stopped waiting" in one, one


# ------------------------------------------------- the fingerprint: parse only to explain a difference

HLO = """HloModule jit_step, entry_computation_layout={(f32[{N}]{0})->f32[{N}]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (p: f32[{N}]) -> f32[{N}] {
  %p = f32[{N}]{0} parameter(0)
  %c = f32[{N}]{0} constant({CONSTANT})
  %m = f32[{N}]{0} multiply(f32[{N}]{0} %p, f32[{N}]{0} %c), {METADATA}
  ROOT %ar = f32[{N}]{0} all-reduce(f32[{N}]{0} %m), channel_id=1, replica_groups={GROUPS}, {ATTRS}
}
"""
METADATA = 'metadata={op_name="jit(step)/mul" source_file="/home/{USER}/train.py" source_line=12}'
ATTRS = ('use_global_device_ids=true, to_apply=%add, '
         'backend_config={"collective_backend_config":{"is_sync":{SYNC}}}')
MESH_GROUPS = "mesh['axis_0'=8,'axis_1'=1] {'axis_0'}"
UNREADABLE = "mesh_v9<<'axis_0'=8>> {'axis_0'}"  # a form XLA might print one day


def _hlo(groups=MESH_GROUPS, constant="2", n=16, user="a", sync="false"):
    return (HLO.replace("{METADATA}", METADATA).replace("{ATTRS}", ATTRS)
            .replace("{GROUPS}", groups).replace("{CONSTANT}", constant)
            .replace("{N}", str(n)).replace("{USER}", user).replace("{SYNC}", sync))


def test_the_fingerprint_ignores_metadata_and_backend_configs_only():
    base = programs.signature(_hlo())
    assert programs.signature(_hlo(user="b", sync="true")).digest() == base.digest()
    for other in (_hlo(constant="3"), _hlo(groups="{{0,1,2,3,4,5,6,7}}"), _hlo(n=15)):
        assert programs.signature(other).digest() != base.digest()
    # The bucket plan is part of it.
    plan = type("Plan", (), {"paths": ("w", "b"), "buckets": (
        type("B", (), {"indices": (0, 1)})(),)})()
    assert programs.signature(_hlo(), plan).digest() != base.digest()
    assert programs.signature(_hlo(), plan).buckets == (("w", "b"),)


def test_equal_fingerprints_never_parse_the_program(monkeypatch):
    """The happy path compares fingerprints: a program in a form nothing can read passes."""
    def unreadable(*a, **k):
        raise AssertionError("parsed on the happy path")

    monkeypatch.setattr(hlo, "collectives", unreadable)
    sigs = [programs.signature(_hlo(UNREADABLE, user=str(p))) for p in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _run(sigs) == [None, None, None]


def test_unreadable_replica_groups_never_stop_a_run():
    """Fingerprints differ but the collectives agree (groups compared as printed, unknown
    ones warned about): a warning, no error. Collectives that differ still raise, the unknown
    groups named as printed."""
    same = [programs.signature(_hlo(UNREADABLE, constant=str(p))) for p in range(2)]
    with pytest.warns(RuntimeWarning) as record:
        assert _run(same) == [None, None]
    messages = [str(w.message) for w in record]
    assert any("could not read the replica groups" in m for m in messages), messages
    assert any("same collectives" in m and "[1] differ" in m for m in messages), messages
    # The description counts them as unknown groups, compared as printed.
    (col,) = same[0].describe().collectives
    assert col.group_size == -1 and col.groups == UNREADABLE
    assert "over unknown groups" in str(col)
    other = [programs.signature(_hlo(UNREADABLE)), programs.signature(_hlo(UNREADABLE, n=8))]
    with pytest.warns(hlo.UnknownReplicaGroupsWarning):
        errs = _run(other)
    assert all(isinstance(e, programs.ProgramMismatchError) and e.index == 0 for e in errs), errs
    assert "process 1 has all-reduce of 32 bytes (f32[8]) over unknown groups" in str(errs[0])


def test_a_program_that_cannot_be_described_warns_and_runs():
    class Broken:
        def __init__(self, digest):
            self._digest = digest

        def digest(self):
            return self._digest

        def describe(self):
            raise RuntimeError("a reader bug")

    with pytest.warns(RuntimeWarning) as record:
        assert _run([Broken("a"), Broken("b")]) == [None, None]
    messages = {str(w.message) for w in record}
    assert any("could not describe this process's step program" in m for m in messages), messages
    assert any("could not read them to compare" in m for m in messages), messages


def test_the_mesh_form_reads_in_the_description():
    """The partitioner's form (an optimizer's global norm over sharded leaves) is read: groups of
    8, compared with the explicit form of the same groups as different text."""
    (col,) = programs.describe(_hlo()).collectives
    assert (col.kind, col.nbytes, col.group_size) == ("all-reduce", 64, 8)
    errs = _run([programs.signature(_hlo()), programs.signature(_hlo("[1,8]<=[8]"))])
    assert all(isinstance(e, programs.ProgramMismatchError) for e in errs)
