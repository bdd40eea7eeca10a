"""Checkpointing: a thin wrapper over orbax-checkpoint's CheckpointManager.

Layout (one folder per step, plain integer names)::

    directory/<step>/state/...            arrays, orbax StandardSave (tensorstore/OCDBT)
    directory/<step>/extra/...            JSON, orbax JsonSave: {"version", "extra", "typed_keys"}
    directory/<step>/_CHECKPOINT_METADATA orbax step metadata

Atomicity: orbax (default ``AtomicRenameTemporaryPath``) writes a step into
``directory/<step>.orbax-checkpoint-tmp[-<ts>]`` and, once every item is written, renames it to
``directory/<step>``. There is no "latest" pointer file: the latest step is the largest finalized
step folder, so a crash mid-save leaves at most an orphan ``*.orbax-checkpoint-tmp*`` folder that
``latest_step``/``all_steps``/``restore`` ignore. A writable ``Checkpointer`` deletes such orphans
when it is constructed (``read_only=True`` — for an evaluator reading a live run — never does, so
it cannot delete a trainer's in-flight save).

State: any pytree of jax.Array / np.ndarray / numpy or Python scalars, including optax states
(namedtuples) and typed PRNG keys (stored as ``jax.random.key_data`` uint32 and re-wrapped on
restore). Exact tree structure (namedtuples, tuples, ``EmptyState``) is only recovered when a
``target`` is given; without one, orbax returns dicts/lists.

Extra: a JSON dict (step, config hash, grain iterator state, ...). ``bytes`` values are stored
as ``{"__b64__": base64}`` and decoded back to ``bytes``; tuples come back as lists; 0-d
numpy/jax arrays come back as Python scalars.
"""

from __future__ import annotations

import base64
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp

TMP_DIR_SUFFIX = ".orbax-checkpoint-tmp"
_B64 = "__b64__"
_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
_FORMAT_VERSION = 1


# ----------------------------------------------------------------------------- pytree helpers
def _path_str(path) -> str:
  """jax key path -> 'opt/0/mu/w' (namedtuple fields and dict keys by name, sequences by index)."""
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:
      parts.append(str(k))
  return "/".join(parts)


def _is_typed_key(x) -> bool:
  dt = getattr(x, "dtype", None)
  return dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)


def _key_impl_name(x) -> str:
  """PRNG impl name of a typed key array or of a ShapeDtypeStruct with a key dtype."""
  if isinstance(x, jax.Array):
    return str(jax.random.key_impl(x))
  for name in _KEY_IMPLS:
    if jax.eval_shape(lambda: jax.random.key(0, impl=name)).dtype == x.dtype:
      return name
  raise ValueError(f"unknown PRNG key dtype {x.dtype}")


def _to_savable(state):
  """Typed keys -> uint32 key data; numpy/Python scalars -> 0-d np arrays. Returns (tree, typed_keys)."""
  typed_keys: dict[str, str] = {}

  def conv(path, x):
    if _is_typed_key(x):
      typed_keys[_path_str(path)] = _key_impl_name(x)
      return jax.random.key_data(x)
    if isinstance(x, (jax.Array, np.ndarray)):
      return x
    if isinstance(x, (np.generic, bool, int, float)):
      return np.asarray(x)
    raise ValueError(
      f"state field {_path_str(path)!r} has unsupported type {type(x).__name__}; expected jax/numpy arrays or scalars"
    )

  return jax.tree_util.tree_map_with_path(conv, state), typed_keys


def _abstract_leaf(path, x):
  """Target leaf -> (what orbax restores into, (shape, dtype) expected on disk)."""
  if _is_typed_key(x):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding), (data.shape, data.dtype)
  if isinstance(x, jax.ShapeDtypeStruct):
    return x, (tuple(x.shape), np.dtype(x.dtype))
  if isinstance(x, jax.Array):
    return (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), (tuple(x.shape), np.dtype(x.dtype)))
  if isinstance(x, (np.ndarray, np.generic, bool, int, float)):
    a = np.asarray(x)
    return np.zeros(a.shape, a.dtype), (a.shape, a.dtype)
  raise ValueError(f"target field {_path_str(path)!r} has unsupported type {type(x).__name__}")


def _from_restored(tgt, val):
  """Cast a restored leaf back to the kind of its target leaf (typed key, scalar, array)."""
  if _is_typed_key(tgt):
    return jax.random.wrap_key_data(val, impl=_key_impl_name(tgt))
  if isinstance(tgt, (bool, int, float)):
    return type(tgt)(np.asarray(val)[()])
  if isinstance(tgt, np.generic):
    return np.asarray(val).astype(tgt.dtype)[()]
  return val


def _check_against_metadata(target_flat: dict, disk_flat: dict, strict_dtype: bool):
  missing = sorted(set(target_flat) - set(disk_flat))
  if missing:
    raise ValueError(
      f"restore target has field(s) absent from the checkpoint: {missing}; checkpoint fields: {sorted(disk_flat)}"
    )
  extra = sorted(set(disk_flat) - set(target_flat))
  if extra:
    raise ValueError(f"checkpoint has field(s) absent from the restore target: {extra}")
  for name, (shape, dtype) in target_flat.items():
    d_shape, d_dtype = disk_flat[name]
    if tuple(shape) != tuple(d_shape):
      raise ValueError(f"field {name!r}: target shape {tuple(shape)} != checkpoint shape {tuple(d_shape)}")
    if strict_dtype and np.dtype(dtype) != np.dtype(d_dtype):
      raise ValueError(
        f"field {name!r}: target dtype {np.dtype(dtype)} != checkpoint dtype "
        f"{np.dtype(d_dtype)} (pass strict_dtype=False to cast)"
      )


# ----------------------------------------------------------------------------- JSON extra
def encode_json(obj, path: str = "extra"):
  """JSON-safe copy of obj: bytes -> {"__b64__": str}, tuples -> lists, 0-d arrays -> scalars."""
  if obj is None or isinstance(obj, (str, bool, int, float)):
    return obj
  if isinstance(obj, (bytes, bytearray)):
    return {_B64: base64.b64encode(bytes(obj)).decode("ascii")}
  if isinstance(obj, dict):
    out = {}
    for k, v in obj.items():
      if not isinstance(k, str):
        raise ValueError(f"{path}: dict key {k!r} is {type(k).__name__}, JSON needs str keys")
      if k == _B64 and len(obj) == 1:
        raise ValueError(f"{path}: the key {_B64!r} is reserved")
      out[k] = encode_json(v, f"{path}/{k}")
    return out
  if isinstance(obj, (list, tuple)):
    return [encode_json(v, f"{path}/{i}") for i, v in enumerate(obj)]
  if isinstance(obj, (np.generic, np.ndarray, jax.Array)) and np.ndim(obj) == 0:
    return np.asarray(obj).item()
  raise ValueError(
    f"{path}: value of type {type(obj).__name__} (shape {np.shape(obj)}) is not "
    "JSON-encodable; put arrays in `state`, not `extra`"
  )


def decode_json(obj):
  """Inverse of encode_json (up to tuple -> list)."""
  if isinstance(obj, dict):
    if len(obj) == 1 and _B64 in obj:
      return base64.b64decode(obj[_B64])
    return {k: decode_json(v) for k, v in obj.items()}
  if isinstance(obj, list):
    return [decode_json(v) for v in obj]
  return obj


# ----------------------------------------------------------------------------- Checkpointer
class Checkpointer:
  """Save/restore (state pytree, extra JSON dict) per step; keeps the last `max_to_keep` steps.

  Args:
    directory: root folder (created if missing unless read_only).
    max_to_keep: number of most recent steps kept (None = keep all).
    save_interval_steps: `save` without `force` only writes when step % interval == 0.
    async_save: if False (default) `save` blocks until the step is finalized on disk; if True it
      returns after the device->host copy and `wait()` must be called before relying on it.
    read_only: never writes, deletes or cleans temporary folders (for readers of a live run).
  """

  def __init__(
    self,
    directory,
    max_to_keep: int | None = 3,
    save_interval_steps: int = 1,
    async_save: bool = False,
    read_only: bool = False,
  ):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
    if save_interval_steps < 1:
      raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
    self.directory = os.path.abspath(os.fspath(directory))
    self.async_save = async_save
    self.read_only = read_only
    if not read_only:
      os.makedirs(self.directory, exist_ok=True)
      self.cleanup_tmp()
    opts = ocp.CheckpointManagerOptions(
      save_interval_steps=0 if read_only else save_interval_steps,
      preservation_policy=ocp.checkpoint_managers.LatestN(max_to_keep),
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=False,  # done synchronously by cleanup_tmp()
      create=not read_only,
      read_only=read_only,
    )
    self._mngr = ocp.CheckpointManager(
      self.directory,
      options=opts,
      item_handlers={"state": ocp.StandardCheckpointHandler(), "extra": ocp.JsonCheckpointHandler()},
    )

  # -- bookkeeping
  def cleanup_tmp(self) -> list[str]:
    """Delete orphan `<step>.orbax-checkpoint-tmp*` folders left by a crashed save."""
    if self.read_only or not os.path.isdir(self.directory):
      return []
    removed = []
    for name in os.listdir(self.directory):
      if TMP_DIR_SUFFIX in name:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        removed.append(name)
    return removed

  def all_steps(self) -> list[int]:
    """Finalized steps on disk, ascending (re-read from disk)."""
    self._mngr.reload()
    return sorted(self._mngr.all_steps())

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def wait(self):
    """Block until any in-flight async save is finalized."""
    self._mngr.wait_until_finished()

  def close(self):
    self._mngr.wait_until_finished()
    self._mngr.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # -- save / restore
  def save(self, step: int, state, extra: dict | None = None, force: bool = False) -> bool:
    """Write `state` (pytree of arrays) and `extra` (JSON dict) as `step`.

    Returns False (nothing written) when the step is not on the save interval or is <= the
    latest saved step, unless force=True. Raises ValueError for non-encodable extra/state.
    """
    if self.read_only:
      raise ValueError("save: this Checkpointer is read_only")
    if extra is not None and not isinstance(extra, dict):
      raise ValueError(f"extra must be a dict or None, got {type(extra).__name__}")
    if not force and not self._mngr.should_save(step):
      return False
    savable, typed_keys = _to_savable(state)
    meta = {
      "version": _FORMAT_VERSION,
      "typed_keys": typed_keys,
      "extra": None if extra is None else encode_json(extra),
    }
    ok = self._mngr.save(
      int(step),
      force=True,
      args=ocp.args.Composite(state=ocp.args.StandardSave(savable), extra=ocp.args.JsonSave(meta)),
    )
    if not self.async_save:
      self._mngr.wait_until_finished()
    return bool(ok)

  def restore(self, step: int | None = None, target=None, strict_dtype: bool = True):
    """Restore `(state, extra)` of `step` (default: latest).

    target: pytree with the state's structure whose leaves are concrete arrays/scalars or
      jax.ShapeDtypeStruct (a `.sharding` on it makes orbax read directly into that sharding;
      without one, arrays land on the default device). Restored leaves get the target's
      tree structure, shapes and dtypes (Python/numpy scalars come back as such, typed keys
      are re-wrapped). A field, shape or (strict_dtype) dtype mismatch raises ValueError
      naming the field. target=None returns orbax's raw tree (dicts/lists).
    """
    self.wait()
    if step is None:
      step = self.latest_step()
      if step is None:
        raise ValueError(f"restore: no finalized checkpoint in {self.directory}")
    elif step not in self.all_steps():
      raise ValueError(f"restore: step {step} not in {self.all_steps()} ({self.directory})")
    meta = self._mngr.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore())).extra
    extra = decode_json(meta.get("extra"))

    if target is None:
      state = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
      impls = meta.get("typed_keys", {})
      if impls:
        state = jax.tree_util.tree_map_with_path(
          lambda p, x: jax.random.wrap_key_data(x, impl=impls[_path_str(p)]) if _path_str(p) in impls else x, state
        )
      return state, extra

    t_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    abstract, expected = [], {}
    for path, leaf in t_leaves:
      a, (shape, dtype) = _abstract_leaf(path, leaf)
      abstract.append(a)
      expected[_path_str(path)] = (shape, dtype)
    disk_tree = self._mngr.item_metadata(step)["state"]
    disk_tree = getattr(disk_tree, "tree", disk_tree)
    disk_leaves = jax.tree_util.tree_flatten_with_path(
      disk_tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
    )[0]
    disk = {_path_str(p): (tuple(m.shape), m.dtype) for p, m in disk_leaves}
    _check_against_metadata(expected, disk, strict_dtype)

    abstract_tree = jax.tree_util.tree_unflatten(treedef, abstract)
    restored = self._mngr.restore(
      step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_tree, strict=True))
    ).state
    got = {_path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(restored)[0]}
    out = [_from_restored(leaf, got[_path_str(path)]) for path, leaf in t_leaves]
    return jax.tree_util.tree_unflatten(treedef, out), extra
