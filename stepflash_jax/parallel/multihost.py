"""Multi-host helpers: distributed init, per-host data, and bringing global arrays back to every host.

On a TPU VM pod slice every host runs the same command; `jax.distributed.initialize()` (no arguments on Cloud TPU)
connects them, after which jax.devices() lists all chips of the slice and a mesh spans all hosts. Each host
loads only its share of the data (`host_shard`) and `mesh.shard_batch` assembles the global batch from the
host-local rows. Orbax checkpoints of global arrays are written and read by all hosts together.
"""

from __future__ import annotations

import jax
import numpy as np


def initialize(enabled: bool, **kwargs) -> tuple[int, int]:
  """jax.distributed.initialize(**kwargs) if enabled (call before any other jax call); -> (process, count)."""
  if enabled:
    jax.distributed.initialize(**kwargs)
  return jax.process_index(), jax.process_count()


def host_shard(ds, index: int | None = None, count: int | None = None):
  """This host's share of a grain MapDataset: ds[index::count] (default: jax.process_index / process_count).

  Slice the example stream *before* packing / batching so every host packs its own documents; with
  `local_batch_size` rows per host the global batch is the concatenation over hosts."""
  index = jax.process_index() if index is None else int(index)
  count = jax.process_count() if count is None else int(count)
  if not 0 <= index < count:
    raise ValueError(f"index must lie in [0, count={count}), got {index}")
  return ds if count == 1 else ds[index::count]


def local_batch_size(global_batch_size: int, count: int | None = None) -> int:
  """Rows each host loads for a global batch; ValueError if the hosts cannot split it evenly."""
  count = jax.process_count() if count is None else int(count)
  if global_batch_size % count:
    raise ValueError(f"batch_size {global_batch_size} is not divisible by the number of hosts {count}")
  return global_batch_size // count


def to_host(tree):
  """Global jax arrays (possibly spread over hosts) -> numpy arrays, the full value on every host."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils

  return jax.tree.map(
    lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)) if isinstance(x, jax.Array) else x, tree
  )
