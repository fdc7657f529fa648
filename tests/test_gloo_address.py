"""jddp.initialize's Gloo interface/address: the option takes effect, and a multi-host job whose
host name resolves to loopback fails at once, naming the fix."""

import socket
import textwrap

import jax
import pytest

import jddp.distributed as dist
from jddp._src.runtime import coordinator
from tests.launch_util import child_env, run_launcher

REMOTE = "198.51.100.1:1234"  # TEST-NET-2: not an address of this host


@pytest.fixture
def loopback_hostname(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    for name in ("JDDP_GLOO_INTERFACE", "JDDP_GLOO_ADDRESS", "JDDP_NNODES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    # These tests pass a documentation address (TEST-NET-2) as the coordinator: the check must
    # refuse it before any connection. Should it ever not, fail here instead of dialling out.
    def no_network(*args, **kwargs):
        raise AssertionError("initialize tried to reach the coordinator before its Gloo check")

    monkeypatch.setattr(coordinator, "wait_for_coordinator", no_network)
    monkeypatch.setattr(jax.distributed, "initialize", no_network)


def test_multi_host_job_with_loopback_hostname_fails_at_once(loopback_hostname, monkeypatch):
    with pytest.raises(dist.GlooAddressError, match="JDDP_GLOO_INTERFACE") as e:
        dist.initialize(REMOTE, 2, 1, timeout_s=1)
    assert "'localhost' resolves to 127.0.0.1 (loopback)" in str(e.value)
    # A multi-node jddp-run says so itself, even with the coordinator on this host (not on
    # loopback, which no other host could reach).
    own = next((a for a in _own_addresses() if not a.startswith("127.")), None)
    if own is not None:
        monkeypatch.setenv("JDDP_NNODES", "2")
        with pytest.raises(dist.GlooAddressError, match="JDDP_GLOO_ADDRESS"):
            dist.initialize(f"{own}:1", 2, 1, timeout_s=1)


def _own_addresses():
    """This host's IPv4 addresses (from the kernel's routing table of local addresses)."""
    import subprocess

    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    return [ln.split()[3].split("/")[0] for ln in out.splitlines() if len(ln.split()) > 3]


def test_gloo_interface_or_address_not_on_this_host(loopback_hostname, monkeypatch):
    with pytest.raises(dist.GlooAddressError, match="no network interface"):
        dist.initialize(REMOTE, 2, 1, timeout_s=1, gloo_interface="nosuch0")
    monkeypatch.setenv("JDDP_GLOO_ADDRESS", "198.51.100.1")
    with pytest.raises(dist.GlooAddressError, match="not an address of this host"):
        dist.initialize(REMOTE, 2, 1, timeout_s=1)


GLOO_SCRIPT = """
import os, subprocess
import jax, numpy as np
import jddp.distributed as dist

dist.initialize(timeout_s=30)
total = dist.allgather(np.int32(jax.process_index() + 1)).sum()
listen = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True).stdout
mine = [ln.split()[3] for ln in listen.splitlines() if f"pid={os.getpid()}," in ln]
print("RANK", jax.process_index(), "SUM", int(total), "GLOO",
      sorted({a.rsplit(":", 1)[0] for a in mine if "127.0.0.1" not in a}))
"""


@pytest.mark.slow
def test_gloo_address_takes_effect(tmp_path):
    script = tmp_path / "gloo.py"
    script.write_text(textwrap.dedent(GLOO_SCRIPT))
    # 127.0.0.2 is a loopback address of its own: the coordinator stays on 127.0.0.1, so any
    # socket of the rank listening on 127.0.0.2 is Gloo's.
    env = child_env(JDDP_GLOO_ADDRESS="127.0.0.2", JAX_PLATFORMS="cpu")
    rc, out, err, _ = run_launcher(["-n", "2", "--timeout", "50", str(script)], timeout=55,
                                   env=env)
    assert rc == 0, (out, err)
    for rank in (0, 1):
        assert f"RANK {rank} SUM 3 GLOO ['127.0.0.2']" in out, (out, err)
