"""A bounded check that every process of a job reached the same collective call.

A collective one process calls alone hangs the job with no hint; :func:`expect_all` turns that
into an error naming the call, the processes that did not come and the fix (a barrier of JAX's
coordination service with a timeout, plus one key per arrival).
"""

from __future__ import annotations

import collections

from jddp._src.introspect import jax_private

__all__ = ["expect_all"]

# How many times this process called expect_all(name): barrier ids must be fresh for each call,
# and every process counts the same calls in the same order.
_CALLS: collections.Counter[str] = collections.Counter()


def expect_all(name: str, what: str, timeout_s: float, fix: str) -> None:
    """Returns once every process has called ``expect_all(name, ...)`` as often as this one.

    Args:
      name: the call's identity (one counter per name), e.g. ``"jddp.checkpoint.save"``.
      what: the call as the message names it, e.g. ``"jddp.checkpoint.save(step=3)"``.
      fix: the sentence that says what to do, for the message.

    Raises:
      RuntimeError: some process did not arrive within ``timeout_s``.
    """
    client, state = jax_private.coordination_client(), jax_private.distributed_state()
    if client is None or (state.num_processes or 1) <= 1:
        return
    _CALLS[name] += 1
    call, me, count = _CALLS[name], state.process_id, state.num_processes
    prefix = f"jddp/expect_all/{name}/{call}/"
    client.key_value_set(prefix + str(me), "1", allow_overwrite=True)
    try:
        client.wait_at_barrier(f"jddp/expect_all/{name}/{call}", int(timeout_s * 1000))
    except Exception as e:  # jax's XlaRuntimeError (DEADLINE_EXCEEDED), or a peer that failed
        try:
            arrived = {int(k.rsplit("/", 1)[-1]) for k, _ in client.key_value_dir_get(prefix)}
        except Exception:  # the coordinator is gone too: say what is known
            arrived = {me}
        missing = [p for p in range(count) if p not in arrived]
        who = (f"process(es) {', '.join(map(str, missing))} did not call it" if missing else
               "the other processes did not all arrive")
        raise RuntimeError(
            f"{what} on process {me}: {who} within {timeout_s:g} s. {fix} "
            f"(coordination service: {str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None
    client.key_value_delete(prefix + str(me))  # every process is past it: no key piles up
