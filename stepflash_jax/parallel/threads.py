"""Independent compiled programs side by side, one host thread each.

XLA:CPU runs much of a small model's program on one thread (batched dots and most small fusions), so two
independent programs dispatched from two threads keep both cores of a small machine busy. On accelerators the
programs queue on the device as before. Each thunk must not depend on another's result.
"""

from __future__ import annotations

import concurrent.futures

import jax


def concurrently(**thunks):
  """Call every thunk in its own thread and wait for all results (jax arrays included): {name: result}."""
  with concurrent.futures.ThreadPoolExecutor(len(thunks)) as pool:
    futures = {k: pool.submit(lambda f=f: jax.block_until_ready(f())) for k, f in thunks.items()}
    return {k: f.result() for k, f in futures.items()}


def thread_map(fn, items, threads: int = 2) -> list:
  """[fn(x) for x in items] (results waited for), `threads` calls at a time, in order."""
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    return list(pool.map(lambda x: jax.block_until_ready(fn(x)), items))
