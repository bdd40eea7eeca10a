"""Independent compiled programs side by side, one host thread each.

XLA:CPU runs much of a small model's program on one thread (batched dots and most small fusions), so two
independent programs dispatched from two threads keep both cores of a small machine busy. On accelerators the
programs queue on the device as before. Each thunk must not depend on another's result.

The mesh (jax.set_mesh) and the logical-axis rules (parallel.use_mesh) are thread-local: every worker runs under
the caller's. A worker without them would trace another program: compiled a second time (the first eval batch in
the caller's thread, the rest in workers: 7-12 s per eval program on 2 cores) and without the model's sharding
constraints and expert parallelism.
"""

from __future__ import annotations

import concurrent.futures

import flax.linen as nn
import jax

from stepflash_jax.parallel.mesh import use_mesh


def _in_callers_mesh(fn):
  """fn, called under the calling thread's mesh and logical-axis rules (whichever thread runs it)."""
  mesh, rules = jax.sharding.get_mesh(), nn.get_logical_axis_rules()

  def call(*args):
    with use_mesh(mesh, rules):
      return jax.block_until_ready(fn(*args))

  return call


def concurrently(**thunks):
  """Call every thunk in its own thread and wait for all results (jax arrays included): {name: result}."""
  with concurrent.futures.ThreadPoolExecutor(len(thunks)) as pool:
    futures = {k: pool.submit(_in_callers_mesh(f)) for k, f in thunks.items()}
    return {k: f.result() for k, f in futures.items()}


def thread_map(fn, items, threads: int = 2) -> list:
  """[fn(x) for x in items] (results waited for), `threads` calls at a time, in order."""
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    return list(pool.map(_in_callers_mesh(fn), items))
