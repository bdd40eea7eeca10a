"""Shardings of the model's variables and of whole training states (params, optimizer moments, router biases).

    variables = state.init_variables(cfg, rng, mesh, rules)            # created directly sharded
    opt = state.init_opt_state(tx, variables["params"], cfg, mesh, rules)
    state.place_state(sft_state, cfg, mesh, rules)                    # reshard an existing state

A variable's mesh PartitionSpec comes from its logical axes (model.logical_axes) through the rules of
parallel/mesh.py; an optimizer leaf is sharded like the variable whose path and shape it matches.
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from stepflash_jax import model as model_lib
from stepflash_jax.parallel.mesh import is_spec, axis_sizes, create_sharded, mesh_specs


@functools.lru_cache(maxsize=32)
def _model_shapes(args, head: str):
  """(logical PartitionSpec tree, ShapeDtypeStruct tree) of the variables; cached per (ModelArgs, head)."""
  with _no_rules():
    return model_lib.logical_axes(args, head), model_lib.abstract_variables(args, head)


def _no_rules():
  """model.abstract_variables unboxes flax metadata, which would apply the logical constraints to shape structs
  under use_mesh; empty rules turn the constraints off for these shape-only calls."""
  return nn.logical_axis_rules(())


def variable_specs(cfg, mesh_or_sizes, rules_, head: str = "lm", dropped: list | None = None):
  """{"params", "router"} tree of mesh PartitionSpecs for the model `cfg` ("lm" actor or "value" critic head)."""
  sizes = mesh_or_sizes if isinstance(mesh_or_sizes, dict) else axis_sizes(mesh_or_sizes)
  logical, shapes = _model_shapes(model_lib.as_args(cfg), head)
  return mesh_specs(logical, rules_, sizes, shapes, dropped)


def variable_shardings(cfg, mesh, rules_, head: str = "lm"):
  """{"params", "router"} tree of NamedShardings (no allocation: built from abstract shapes)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), variable_specs(cfg, mesh, rules_, head), is_leaf=is_spec)


def _key(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _lookup(cfg, sizes, rules_, heads) -> dict:
  """{(path without the collection name): (shape, PartitionSpec)} over the variables of the given heads."""
  table = {}
  for head in heads:
    specs = variable_specs(cfg, sizes, rules_, head)
    shapes = _model_shapes(model_lib.as_args(cfg), head)[1]
    flat_s = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    flat_x = jax.tree.leaves(shapes)
    for (path, spec), x in zip(flat_s, flat_x):
      table[tuple(_key(k) for k in path[1:])] = (tuple(x.shape), spec)
  return table


def state_specs(state, cfg, mesh_or_sizes, rules_, heads: Sequence[str] = ("lm", "value")):
  """Mesh PartitionSpecs for any pytree `state` (arrays or ShapeDtypeStructs, e.g. jax.eval_shape of the state
  builder) holding variables and optimizer states: a leaf whose key path ends with a variable's path (within its
  collection) and has that variable's shape is sharded like it (params, Muon momentum, AdamW mu/nu, router bias,
  the value head); everything else (step counters, scalars, PRNG keys) is replicated."""
  sizes = mesh_or_sizes if isinstance(mesh_or_sizes, dict) else axis_sizes(mesh_or_sizes)
  table = _lookup(cfg, sizes, rules_, tuple(heads))
  longest = max((len(k) for k in table), default=0)

  def one(path, x):
    keys = tuple(_key(k) for k in path)
    shape = tuple(getattr(x, "shape", ()))
    for n in range(min(longest, len(keys)), 0, -1):
      hit = table.get(keys[-n:])
      if hit is not None and hit[0] == shape:
        return hit[1]
    return P()

  return jax.tree_util.tree_map_with_path(one, state)


def state_shardings(state, cfg, mesh, rules_, heads: Sequence[str] = ("lm", "value")):
  """NamedShardings of `state_specs` on `mesh`."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(state, cfg, mesh, rules_, heads), is_leaf=is_spec)


def init_variables(cfg, rng, mesh, rules_, head: str = "lm", per_leaf: bool = False):
  """Random variables created directly sharded (never a full host copy).

  per_leaf=False: exactly model.init(cfg, rng, head) (one flat normal draw sliced into leaves; threefry is
  partitionable, so the values do not depend on the mesh) -- XLA reshuffles the slices between devices, fine at
  toy scale. per_leaf=True: every leaf drawn on its own (normal(init_std) from fold_in(rng, leaf index); norm
  scales, router biases and the value head zero, as model.init), so each device only generates its shards: use
  this for the 196B model (different random values than model.init)."""
  args = model_lib.as_args(cfg)
  shardings = variable_shardings(args, mesh, rules_, head)
  if not per_leaf:
    with _no_rules():
      return create_sharded(lambda r: model_lib.init(args, r, head), rng, shardings=shardings)
  shapes = _model_shapes(args, head)[1]
  paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)

  def sample(rng):
    out = []
    for i, (path, x) in enumerate(paths):
      names = [_key(k) for k in path]
      if names[-1] in ("scale", "router_bias") or "value_head" in names:
        out.append(jax.numpy.zeros(x.shape, x.dtype))
      else:
        out.append((args.init_std * jax.random.normal(jax.random.fold_in(rng, i), x.shape)).astype(x.dtype))
    return jax.tree.unflatten(treedef, out)

  return create_sharded(sample, rng, shardings=shardings)


def init_opt_state(tx, params, cfg, mesh, rules_):
  """tx.init(params) with every moment / momentum sharded like its parameter (scalars replicated)."""
  abstract = jax.eval_shape(tx.init, params)
  return create_sharded(tx.init, params, shardings=state_shardings(abstract, cfg, mesh, rules_))


def place_state(state, cfg, mesh, rules_):
  """Reshard an existing state pytree (e.g. the SFT result handed to RL, or a single-device state in tests)."""
  return jax.device_put(state, state_shardings(state, cfg, mesh, rules_))


def describe(cfg, mesh_or_sizes, rules_, head: str = "lm") -> dict:
  """{"params/...": "P(...)"} of every variable (for logs and the golden files)."""
  specs = variable_specs(cfg, mesh_or_sizes, rules_, head)
  flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
  return {"/".join(_key(k) for k in path): str(spec) for path, spec in flat}
