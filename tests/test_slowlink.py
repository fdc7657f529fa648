"""The slow-link harness (benchmarks/slowlink): two network namespaces joined by a shaped veth,
one JAX process of 4 devices in each, started by the multi-node launcher. A short smoke: the
bytes that really cross the veth match jddp's model within 10%. Root and `ip netns` only; the
harness holds a lock (never two runs at once) and removes what it made, also on failure."""

import os
import subprocess

import pytest

from benchmarks.slowlink import bench, netns


@pytest.fixture(scope="module")
def available():
    try:
        netns.check_available()
    except netns.HarnessUnavailable as e:
        pytest.skip(str(e))


def _ours() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [ln.split()[0] for ln in out.splitlines()
            if ln.startswith(f"{netns.PREFIX}{os.getpid()}")]


@pytest.mark.slow
def test_bytes_on_the_wire_match_the_model(available):
    args = bench.parse_args(["--variants", "flat", "hierarchical", "int8", "--rates", "1gbit",
                             "--rounds", "1", "--steps", "2", "--width", "512", "--depth", "4",
                             "--batch", "64"])
    result = bench.run(args, timeout_s=150)
    assert not _ours() and not os.path.exists(f"/etc/netns/{netns.PREFIX}{os.getpid()}a")
    rows = result["rates"]["1gbit"]
    assert set(rows) == {"flat", "hierarchical", "int8"}
    for name, r in rows.items():
        for sent in r["wire_bytes_by_host"]:  # each host's own veth end
            assert sent == pytest.approx(r["model_bytes"], rel=0.10), (name, r)
        assert r["model_bytes"] == pytest.approx(r["hlo_across"], rel=1e-3), (name, r)
    # Hierarchical sends 2(M-1)/M of the gradients across, flat 2(N-1)/N; int8 about a quarter.
    assert rows["hierarchical"]["wire_bytes"] < 0.65 * rows["flat"]["wire_bytes"]
    assert rows["int8"]["wire_bytes"] < 0.5 * rows["flat"]["wire_bytes"]


def test_cleans_up_after_a_failure(available):
    with pytest.raises(RuntimeError, match="boom"):
        with netns.SlowLink() as link:
            link.shape("300mbit")
            sleeper = link.run(0, ["sleep", "1000"])
            assert len(_ours()) == 2
            raise RuntimeError("boom")
    assert not _ours()
    assert not any(os.path.exists(f"/etc/netns/{n}") for n in link.namespaces)
    assert sleeper.poll() is not None  # ended by PID
