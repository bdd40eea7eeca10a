"""Parallelism: the device mesh and logical-axis rules (mesh.py; the expert-parallel MoE lives in
model/moe_parallel.py), per-device kernels under GSPMD (local_ops.py), multi-host helpers (multihost.py),
independent programs side by side (threads.py), independent stages in processes, work beside a stage (processes.py).

    mesh = parallel.make_mesh(config.mesh)                 # data / fsdp / expert / tensor
    rules = parallel.rules(config)                         # config.mesh.rules + DEFAULT_RULES
    with parallel.use_mesh(mesh, rules):                   # constraints + expert parallelism active while tracing
      variables = train.state.init_variables(cfg, rng, mesh, rules)   # variable shardings: train/state.py
      state, metrics = step(state, parallel.shard_batch(batch, mesh, rules))
"""

from stepflash_jax.parallel import local_ops, multihost
from stepflash_jax.parallel.mesh import (
  BATCH_AXES,
  DEFAULT_RULES,
  MESH_AXES,
  axis_sizes,
  batch_axes,
  batch_sharding,
  check_rules,
  create_sharded,
  make_mesh,
  mesh_shape,
  mesh_specs,
  replicated,
  resolve,
  rules,
  shard_batch,
  use_mesh,
)
from stepflash_jax.parallel.multihost import host_shard, initialize, local_batch_size, to_host
from stepflash_jax.parallel.processes import beside, side_by_side
from stepflash_jax.parallel.threads import concurrently, thread_map

__all__ = [
  "BATCH_AXES",
  "DEFAULT_RULES",
  "MESH_AXES",
  "axis_sizes",
  "batch_axes",
  "beside",
  "batch_sharding",
  "check_rules",
  "concurrently",
  "create_sharded",
  "host_shard",
  "initialize",
  "local_batch_size",
  "local_ops",
  "make_mesh",
  "mesh_shape",
  "mesh_specs",
  "multihost",
  "replicated",
  "resolve",
  "rules",
  "shard_batch",
  "side_by_side",
  "thread_map",
  "to_host",
  "use_mesh",
]
