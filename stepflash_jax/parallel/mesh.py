"""Device mesh, logical-axis rules and the shardings of variables, optimizer state and batches.

Mesh: five named axes in this order (innermost = fastest interconnect last)

    data     pure data parallelism: parameters replicated, batch split
    fsdp     ZeRO-3: batch split *and* every parameter split along its "embed" dimension
    expert   expert parallelism: the experts split; for everything else it acts like fsdp (batch and "embed" split)
    context  context (sequence) parallelism: the "length" dimension of activations split, parameters replicated;
             attention exchanges a halo (sliding-window layers) or K/V blocks (full layers): parallel/context.py
    tensor   Megatron tensor parallelism: heads / mlp / vocab split

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
import math
from typing import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")

DEFAULT_RULES = (
  # activations (listed first: a batch dimension takes data/fsdp/expert before "embed" can)
  ("batch", ("data", "fsdp", "expert")),
  ("length", "context"),
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


def as_tuple(axes) -> tuple:
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
    axes = as_tuple(r[1])
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
  later rule; mesh axes of size 1 are left out (the same layout, so the same compiled program - and persistent
  compilation-cache entry - whether the arrays come from `init` or a checkpoint). Without them the raw rule
  resolution is returned (what the golden files record).
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
    axes = as_tuple(mesh_axes)
    if used & set(axes):
      continue
    if axis_sizes is not None:  # size-1 axes split nothing: leaving them out keeps one program per real layout
      axes = tuple(a for a in axes if axis_sizes[a] > 1)
      if not axes:
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


def is_spec(x) -> bool:
  return isinstance(x, P)


def mesh_specs(logical_tree, rules_, axis_sizes: dict | None = None, shapes_tree=None, dropped: list | None = None):
  """Tree of logical PartitionSpecs (model.logical_axes) -> tree of mesh PartitionSpecs (see `resolve`)."""
  if shapes_tree is None:
    return jax.tree.map(lambda s: resolve(tuple(s), rules_), logical_tree, is_leaf=is_spec)
  return jax.tree.map(
    lambda s, x: resolve(tuple(s), rules_, axis_sizes, x.shape, dropped), logical_tree, shapes_tree, is_leaf=is_spec
  )


# ---------------------------------------------------------------------------------------------------------------
# Mesh


def config_error(field, msg):
  """The one-line ValueError of run-config validation, naming the field."""
  raise ValueError(f"config field '{field}': {msg}")


def mesh_shape(mesh_cfg, num_devices: int) -> dict:
  """{axis: size} of config.mesh with one -1 filled in; ValueError naming the field if it does not fit.
  `context` may be left out (size 1)."""
  axes = {k: int(mesh_cfg[k]) if k in mesh_cfg or k != "context" else 1 for k in MESH_AXES}
  free = [k for k, v in axes.items() if v == -1]
  if len(free) > 1:
    config_error(f"mesh.{free[1]}", "at most one mesh axis may be -1")
  for k, v in axes.items():
    if v == 0 or v < -1:
      config_error(f"mesh.{k}", f"must be a positive size or -1, got {v}")
  known = math.prod(v for v in axes.values() if v != -1)
  if free:
    if num_devices % known:
      config_error(f"mesh.{free[0]}", f"cannot fill {num_devices} devices with the other axes' product {known}")
    axes[free[0]] = num_devices // known
  elif known != num_devices:
    config_error("mesh", f"axis sizes {axes} multiply to {known} but there are {num_devices} devices")
  return axes


def make_mesh(mesh_cfg, devices: Sequence | None = None) -> jax.sharding.Mesh:
  """A jax Mesh with axes MESH_AXES (Auto/GSPMD axis types) over `devices` (default: all devices, all hosts).

  mesh_cfg: config.mesh (or a dict) with integer sizes data/fsdp/expert/(context)/tensor, one may be -1.
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


def create_sharded(fn, *args, shardings):
  """fn(*args) computed under jit directly into `shardings` (each device materialises only its shards)."""
  return jax.jit(fn, out_shardings=shardings)(*args)


# ---------------------------------------------------------------------------------------------------------------
# Batches


def batch_axes(mesh, batch_size: int, rules_=None) -> tuple:
  """Mesh axes for a leading batch dimension of `batch_size`: the mesh axes of the logical "batch" rule, keeping
  the subset (in order) with the largest product that divides batch_size."""
  axes = as_tuple(resolve(("batch",), rules_ or DEFAULT_RULES)[0])
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
