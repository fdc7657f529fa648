"""Where Gloo (JAX's CPU collectives) listens: checked before a multi-host job starts, and set
when an interface or address is given."""

from __future__ import annotations

import os
import socket

import jax

from jddp._src.introspect import jax_private
from jddp._src.runtime.coordinator import (
    ENV_GLOO_ADDRESS,
    ENV_GLOO_INTERFACE,
    ENV_NNODES,
    env_int,
    is_local_address,
    is_loopback,
    resolve,
    split_address,
)


class GlooAddressError(RuntimeError):
    """Gloo would listen on an address other hosts cannot reach (this host's name resolves to
    loopback), or the interface or address given for it is not on this host."""


def _gloo_default_address() -> str | None:
    """The address Gloo listens on when given neither an interface nor an address: the first
    address this host's name resolves to that it can bind (Gloo's ``lookupAddrForHostname``)."""
    return next((a for a in resolve(socket.gethostname()) if is_local_address(a)), None)


def _spans_hosts(coordinator_address: str, nnodes: int | None = None) -> bool:
    """Whether the job has processes on other hosts: not with a coordinator on loopback (no
    other host could reach it); else the launcher's node count ``nnodes`` (mpirun, srun) or
    ``JDDP_NNODES`` (a multi-node jddp-run) says so; else a coordinator that is not an address
    of this host does."""
    addresses = resolve(split_address(coordinator_address)[0])
    if any(is_loopback(a) for a in addresses):
        return False
    if nnodes is None:
        nnodes = env_int(ENV_NNODES)
    if nnodes is not None:
        return nnodes > 1
    return bool(addresses) and not any(is_local_address(a) for a in addresses)


def uses_cpu_collectives() -> bool:
    """Gloo carries this job's collectives: CPU first (or no platform named), Gloo chosen."""
    if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") not in (None, "gloo"):
        return False
    platforms = getattr(jax.config, "jax_platforms", None) or os.environ.get("JAX_PLATFORMS") or ""
    return platforms.split(",")[0].strip() in ("", "cpu")


def check_gloo(interface: str | None, address: str | None, coordinator_address: str,
                nnodes: int | None = None) -> None:
    """Raises `GlooAddressError` before the job starts if Gloo would listen where the other
    hosts cannot reach it, or the interface or address given is not on this host."""
    fixes = (f"set {ENV_GLOO_INTERFACE}=<interface the other hosts reach, e.g. eth0> or "
             f"{ENV_GLOO_ADDRESS}=<this host's address> (or jddp.initialize(gloo_interface=..., "
             "gloo_address=...)), or map this host's name to that address in /etc/hosts")
    if interface:
        try:
            socket.if_nametoindex(interface)
        except OSError:
            raise GlooAddressError(
                f"jddp: gloo_interface={interface!r} ({ENV_GLOO_INTERFACE}): this host has no "
                "network interface of that name (`ip -br addr` lists them)."
            ) from None
        return
    if address:
        if not any(is_local_address(a) for a in resolve(address)):
            raise GlooAddressError(
                f"jddp: gloo_address={address!r} ({ENV_GLOO_ADDRESS}) is not an address of this "
                "host, so Gloo cannot listen on it. Give one of this host's addresses "
                "(`ip -br addr`), or an interface name with gloo_interface."
            )
        return
    if not _spans_hosts(coordinator_address, nnodes):
        return
    bound = _gloo_default_address()
    if bound is None or is_loopback(bound):
        raise GlooAddressError(
            f"jddp: this host's name {socket.gethostname()!r} resolves to "
            f"{bound or 'no address it can bind'}"
            f"{' (loopback)' if bound else ''}, and JAX gives Gloo (its CPU collectives) no "
            "interface, so Gloo would listen there and processes on the other hosts could not "
            "connect (the job would fail after seconds on one rank and abort only after the "
            f"heartbeat timeout on the others). Fix: {fixes}."
        )


def configure_gloo(interface: str | None, address: str | None) -> None:
    """Makes JAX's CPU backend create its Gloo collectives on ``interface`` or ``address``.

    JAX 0.10.2 calls ``make_gloo_tcp_collectives(distributed_client)`` without them (Gloo then
    binds what the host name resolves to); the CPU backend is created lazily, so registering a
    factory that passes them before the first JAX computation is enough.
    """
    if not (interface or address) or not uses_cpu_collectives():
        return
    try:
        jax_private.register_gloo_cpu_backend(None if interface else address, interface or None)
    except RuntimeError as e:
        raise RuntimeError(
            "jddp.initialize must run before anything initialises JAX's backend: cannot set "
            "the Gloo interface now"
        ) from e
