"""Parallelism: the device mesh and logical-axis rules (mesh.py), the expert-parallel MoE (expert_parallel.py),
per-device kernels under GSPMD (local_ops.py), multi-host helpers (multihost.py).

    mesh = parallel.make_mesh(config.mesh)                 # data / fsdp / expert / tensor
    rules = parallel.rules(config)                         # config.mesh.rules + DEFAULT_RULES
    with parallel.use_mesh(mesh, rules):                   # constraints + expert parallelism active while tracing
      variables = parallel.init_variables(cfg, rng, mesh, rules)
      opt = parallel.init_opt_state(tx, variables["params"], cfg, mesh, rules)
      state, metrics = step(state, parallel.shard_batch(batch, mesh, rules))
"""

from stepflash_jax.parallel import expert_parallel, local_ops, multihost
from stepflash_jax.parallel.mesh import (
  BATCH_AXES,
  DEFAULT_RULES,
  MESH_AXES,
  axis_sizes,
  batch_axes,
  batch_sharding,
  check_rules,
  create_sharded,
  describe,
  init_opt_state,
  init_variables,
  make_mesh,
  mesh_shape,
  mesh_specs,
  place_state,
  replicated,
  resolve,
  rules,
  shard_batch,
  state_shardings,
  state_specs,
  use_mesh,
  variable_shardings,
  variable_specs,
)
from stepflash_jax.parallel.multihost import host_shard, initialize, local_batch_size, to_host

__all__ = [
  "BATCH_AXES",
  "DEFAULT_RULES",
  "MESH_AXES",
  "axis_sizes",
  "batch_axes",
  "batch_sharding",
  "check_rules",
  "create_sharded",
  "describe",
  "expert_parallel",
  "host_shard",
  "init_opt_state",
  "init_variables",
  "initialize",
  "local_batch_size",
  "local_ops",
  "make_mesh",
  "mesh_shape",
  "mesh_specs",
  "multihost",
  "place_state",
  "replicated",
  "resolve",
  "rules",
  "shard_batch",
  "state_shardings",
  "state_specs",
  "to_host",
  "use_mesh",
  "variable_shardings",
  "variable_specs",
]
