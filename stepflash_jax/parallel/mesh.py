"""Device mesh, logical-axis rules and the shardings of variables, optimizer state and batches.

Mesh: four named axes in this order (innermost = fastest interconnect last)

    data    pure data parallelism: parameters replicated, batch split
    fsdp    ZeRO-3: batch split *and* every parameter split along its "embed" dimension
    expert  expert parallelism: the experts split; for everything else it acts like fsdp (batch and "embed" split)
    tensor  Megatron tensor parallelism: heads / mlp / vocab split

Rules (MaxText style): a tuple of (logical axis name, mesh axes) pairs in order of precedence. A dimension named
`logical` gets the mesh axes of the first rule for that name whose mesh axes are not already used by another
dimension of the same array (flax's `logical_to_mesh_axes` algorithm). Parameters (resolved here, with their
shapes) additionally drop trailing mesh axes that do not divide the dimension, so the tiny test model and odd
head counts still shard; activations are constrained by the model through `nn.with_logical_constraint`, which is
only effective inside `use_mesh(mesh, rules)` (jax.set_mesh + flax.linen.logical_axis_rules). GSPMD accepts
uneven activation shardings (it pads).

`config.mesh.rules` (optional) is prepended to DEFAULT_RULES, so it overrides: e.g. (("vocab", None),) stops
sharding the vocabulary, (("embed", "fsdp"),) keeps "embed" off the expert axis.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")

DEFAULT_RULES = (
  # activations (listed first: a batch dimension takes data/fsdp/expert before "embed" can)
  ("batch", ("data", "fsdp", "expert")),
  ("length", None),
  # parameters and activations
  ("expert", "expert"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("mlp", "tensor"),
  ("vocab", "tensor"),
  ("embed", ("fsdp", "expert")),  # dense weights: ZeRO-3 over fsdp x expert ...
  ("embed", "fsdp"),  # ... expert weights [E, H, F]: E took "expert", H gets fsdp only
  ("concat_embed", ("fsdp", "expert")),
  ("concat_embed", "fsdp"),
  ("head_dim", None),
  ("layers", None),
)


# ---------------------------------------------------------------------------------------------------------------
# Rules and their resolution


def _as_tuple(axes) -> tuple:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _pack(axes: tuple):
  return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def check_rules(rules) -> tuple:
  """Normalise a rules table to a tuple of (str, None | str | tuple[str]) and validate the mesh axis names."""
  out = []
  for i, r in enumerate(rules):
    if not isinstance(r, (tuple, list)) or len(r) != 2 or not isinstance(r[0], str):
      raise ValueError(f"config field 'mesh.rules': entry {i} must be a (logical name, mesh axes) pair, got {r!r}")
    axes = _as_tuple(r[1])
    bad = [a for a in axes if a not in MESH_AXES]
    if bad:
      raise ValueError(
        f"config field 'mesh.rules': entry {i} {tuple(r)!r} names unknown mesh axes {bad}; mesh axes are {MESH_AXES}"
      )
    out.append((r[0], _pack(axes)))
  return tuple(out)


def rules(config=None) -> tuple:
  """The rules table of a run config: config.mesh.rules (if any) prepended to DEFAULT_RULES."""
  extra = ()
  if config is not None:
    mesh_cfg = config["mesh"] if "mesh" in config else config
    if "rules" in mesh_cfg and mesh_cfg["rules"]:
      extra = tuple(tuple(r) for r in mesh_cfg["rules"])
  return check_rules(extra + DEFAULT_RULES)


def resolve(
  names: Sequence[str | None],
  rules_: Sequence,
  axis_sizes: dict | None = None,
  shape: Sequence[int] | None = None,
  dropped: list | None = None,
) -> P:
  """Logical names of one array -> mesh PartitionSpec.

  Precedence as flax: rules in order; a rule applies to a still-unassigned dimension if none of its mesh axes is
  used yet. With `axis_sizes` and `shape`, trailing mesh axes whose product does not divide the dimension are
  dropped (recorded in `dropped` as (names, dim, removed axes)); if none remain the dimension stays open for a
  later rule. Without them the raw rule resolution is returned (what the golden files record).
  """
  names = tuple(names)
  if len(set(n for n in names if n is not None)) != len([n for n in names if n is not None]):
    raise ValueError(f"logical axis names {names} repeat a name")
  result = [... if n is not None else None for n in names]  # ... = not assigned yet
  used: set = set()
  for logical, mesh_axes in rules_:
    if logical not in names:
      continue
    pos = names.index(logical)
    if result[pos] is not ...:
      continue
    axes = _as_tuple(mesh_axes)
    if used & set(axes):
      continue
    if axes and axis_sizes is not None and shape is not None:
      keep = axes
      while keep and shape[pos] % math.prod(axis_sizes[a] for a in keep):
        keep = keep[:-1]
      if keep != axes and dropped is not None:
        dropped.append((names, int(shape[pos]), axes[len(keep) :]))
      if not keep:
        continue
      axes = keep
    result[pos] = axes
    used |= set(axes)
  return P(*[None if r is ... else _pack(r) for r in result])


def _is_spec(x) -> bool:
  return isinstance(x, P)


def mesh_specs(logical_tree, rules_, axis_sizes: dict | None = None, shapes_tree=None, dropped: list | None = None):
  """Tree of logical PartitionSpecs (model.logical_axes) -> tree of mesh PartitionSpecs (see `resolve`)."""
  if shapes_tree is None:
    return jax.tree.map(lambda s: resolve(tuple(s), rules_), logical_tree, is_leaf=_is_spec)
  return jax.tree.map(
    lambda s, x: resolve(tuple(s), rules_, axis_sizes, x.shape, dropped), logical_tree, shapes_tree, is_leaf=_is_spec
  )


# ---------------------------------------------------------------------------------------------------------------
# Mesh


def mesh_shape(mesh_cfg, num_devices: int) -> dict:
  """{axis: size} of config.mesh with one -1 filled in; ValueError naming the field if it does not fit."""
  from stepflash_jax.train.validate import mesh_shape as _shape

  return _shape(mesh_cfg, num_devices)


def make_mesh(mesh_cfg, devices: Sequence | None = None) -> jax.sharding.Mesh:
  """A jax Mesh with axes MESH_AXES (Auto/GSPMD axis types) over `devices` (default: all devices, all hosts).

  mesh_cfg: config.mesh (or a dict) with integer sizes data/fsdp/expert/tensor, one may be -1.
  On TPU jax.make_mesh orders the devices along the physical topology (tensor innermost)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(mesh_cfg, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  if len(devices) == jax.device_count() and devices == list(jax.devices()):
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
  return jax.sharding.Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def axis_sizes(mesh) -> dict:
  return dict(zip(mesh.axis_names, mesh.axis_sizes)) if hasattr(mesh, "axis_sizes") else dict(mesh.shape)


@contextlib.contextmanager
def use_mesh(mesh, rules_):
  """Trace (and run) under `mesh` with `rules_`: makes the model's nn.with_logical_constraint effective and
  enables the expert-parallel MoE. Functions jitted outside but first *called* inside are traced inside."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules_):
    yield


# ---------------------------------------------------------------------------------------------------------------
# Shardings of variables and of whole training states


@functools.lru_cache(maxsize=32)
def _model_shapes(args, head: str):
  """(logical PartitionSpec tree, ShapeDtypeStruct tree) of the variables; cached per (ModelArgs, head)."""
  from stepflash_jax import model as model_lib

  with _no_rules():
    return model_lib.logical_axes(args, head), model_lib.abstract_variables(args, head)


def _no_rules():
  """model.abstract_variables unboxes flax metadata, which would apply the logical constraints to shape structs
  under use_mesh; empty rules turn the constraints off for these shape-only calls."""
  return nn.logical_axis_rules(())


def variable_specs(cfg, mesh_or_sizes, rules_, head: str = "lm", dropped: list | None = None):
  """{"params", "router"} tree of mesh PartitionSpecs for the model `cfg` ("lm" actor or "value" critic head)."""
  from stepflash_jax import model as model_lib

  sizes = mesh_or_sizes if isinstance(mesh_or_sizes, dict) else axis_sizes(mesh_or_sizes)
  logical, shapes = _model_shapes(model_lib.as_args(cfg), head)
  return mesh_specs(logical, rules_, sizes, shapes, dropped)


def variable_shardings(cfg, mesh, rules_, head: str = "lm"):
  """{"params", "router"} tree of NamedShardings (no allocation: built from abstract shapes)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), variable_specs(cfg, mesh, rules_, head), is_leaf=_is_spec)


def _key(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _lookup(cfg, sizes, rules_, heads) -> dict:
  """{(path without the collection name): (shape, PartitionSpec)} over the variables of the given heads."""
  from stepflash_jax import model as model_lib

  table = {}
  for head in heads:
    specs = variable_specs(cfg, sizes, rules_, head)
    shapes = _model_shapes(model_lib.as_args(cfg), head)[1]
    flat_s = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]
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
  return jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(state, cfg, mesh, rules_, heads), is_leaf=_is_spec)


def create_sharded(fn, *args, shardings):
  """fn(*args) computed under jit directly into `shardings` (each device materialises only its shards)."""
  return jax.jit(fn, out_shardings=shardings)(*args)


def init_variables(cfg, rng, mesh, rules_, head: str = "lm", per_leaf: bool = False):
  """Random variables created directly sharded (never a full host copy).

  per_leaf=False: exactly model.init(cfg, rng, head) (one flat normal draw sliced into leaves; threefry is
  partitionable, so the values do not depend on the mesh) -- XLA reshuffles the slices between devices, fine at
  toy scale. per_leaf=True: every leaf drawn on its own (normal(init_std) from fold_in(rng, leaf index); norm
  scales, router biases and the value head zero, as model.init), so each device only generates its shards: use
  this for the 196B model (different random values than model.init)."""
  from stepflash_jax import model as model_lib

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


# ---------------------------------------------------------------------------------------------------------------
# Batches


def batch_axes(mesh, batch_size: int, rules_=None) -> tuple:
  """Mesh axes for a leading batch dimension of `batch_size`: the mesh axes of the logical "batch" rule, keeping
  the subset (in order) with the largest product that divides batch_size."""
  axes = _as_tuple(resolve(("batch",), rules_ or DEFAULT_RULES)[0])
  sizes = axis_sizes(mesh)
  best = ()
  for mask in range(1 << len(axes)):
    sub = tuple(a for i, a in enumerate(axes) if mask >> i & 1)
    n = math.prod(sizes[a] for a in sub)
    if batch_size % n == 0 and n > math.prod(sizes[a] for a in best):
      best = sub
  return best


def batch_sharding(mesh, shape: Sequence[int], rules_=None) -> NamedSharding:
  return NamedSharding(mesh, P(_pack(batch_axes(mesh, int(shape[0]), rules_)), *([None] * (len(shape) - 1))))


def shard_batch(batch, mesh, rules_=None, global_batch: bool = False):
  """Put every array of a batch dict on the mesh, split along its leading (batch) dimension.

  global_batch=False (SFT): each host passes its own rows (see multihost.host_shard / local_batch_size) and gets
  global arrays of process_count x the rows (jax.make_array_from_process_local_data). global_batch=True (RL
  prompts / generations, identical on every host): every host passes the whole batch and keeps its shards.
  With one host both are a plain device_put. Non-array entries (e.g. a prompt batch's examples) pass through."""

  def put(x):
    if not isinstance(x, (np.ndarray, jax.Array)) or np.ndim(x) == 0:
      return x
    x = np.asarray(x)
    if jax.process_count() == 1:
      return jax.device_put(x, batch_sharding(mesh, x.shape, rules_))
    if global_batch:
      return jax.make_array_from_callback(x.shape, batch_sharding(mesh, x.shape, rules_), lambda idx: x[idx])
    global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
    return jax.make_array_from_process_local_data(batch_sharding(mesh, global_shape, rules_), x, global_shape)

  if isinstance(batch, dict):
    return {k: put(v) for k, v in batch.items()}
  return jax.tree.map(put, batch)


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def describe(cfg, mesh_or_sizes, rules_, head: str = "lm") -> dict:
  """{"params/...": "P(...)"} of every variable (for logs and the golden files)."""
  specs = variable_specs(cfg, mesh_or_sizes, rules_, head)
  flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]
  return {"/".join(_key(k) for k in path): str(spec) for path, spec in flat}


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
  "init_opt_state",
  "init_variables",
  "make_mesh",
  "mesh_shape",
  "mesh_specs",
  "place_state",
  "replicated",
  "resolve",
  "rules",
  "shard_batch",
  "state_shardings",
  "state_specs",
  "use_mesh",
  "variable_shardings",
  "variable_specs",
]
