"""Validation of the RL functions' array arguments (losses, advantages, routing): static shapes and dtypes are
checked before anything is computed, so it also works under jit; errors name the argument and list dtype[shape]."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _as_array(x):
  """x itself when it has a dtype and a shape, else jnp.asarray(x); None when it is no array (a str, None, a dict,
  a ragged list)."""
  if getattr(x, "dtype", None) is not None and getattr(x, "shape", None) is not None:
    return x
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError):
    return None


def desc(x) -> str:
  a = _as_array(x)
  return type(x).__name__ if a is None else f"{jnp.dtype(a.dtype).name}{list(a.shape)}"


def _numeric(x) -> bool:
  """An array (or nested list) of numbers or bools."""
  a = _as_array(x)
  return a is not None and (jnp.dtype(a.dtype) == jnp.bool_ or jnp.issubdtype(a.dtype, jnp.number))


def fail(fn: str, problem: str, arrays: dict):
  got = ", ".join(f"{k} {desc(v)}" for k, v in arrays.items())
  raise ValueError(f"{fn}: {problem}. Got: {got}")


def is_mask_dtype(dtype) -> bool:
  dtype = jnp.dtype(dtype)
  return dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer) or dtype in (jnp.float32, jnp.float64)


def as_compute(x, dtype):
  """float64 input -> float32 (float64 if jax x64 is enabled); other dtypes unchanged."""
  if dtype == jnp.float64:
    return jnp.asarray(x, jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
  return jnp.asarray(x)


def check_arrays(
  fn: str, arrays: dict, *, ndim: int = 2, masks: tuple = ("mask",), shape=None, expect=None, context=None
):
  """Check that every array in ``arrays`` has rank ``ndim`` and one common shape (``shape`` if given, else
  the first array's), float32 or float64 dtype, and for the names in ``masks`` bool/integer/float32/float64.
  Raises ValueError naming the offending array and listing dtype[shape] of all arrays (plus ``context``, other
  arguments of the call); ``expect`` describes the wanted shape, e.g. "[B, T+1]". Returns the arrays as jnp
  arrays, in order; float64 ones (e.g. NumPy defaults) are computed in float32, or float64 when jax x64 is on.
  Lower precisions (float16, bfloat16) are refused: they would silently lose the ratio's precision."""
  shown = {**arrays, **(context or {})}
  dtypes = []
  ref_name = next(iter(arrays))
  for name, x in arrays.items():
    if not _numeric(x):
      fail(fn, f"{name} must be a numeric array, got {type(x).__name__}", shown)
  ref_shape = tuple(shape) if shape is not None else tuple(jnp.shape(arrays[ref_name]))
  want = f" {expect}" if expect else ""
  for name, x in arrays.items():
    x_shape = tuple(jnp.shape(x))
    if len(x_shape) != ndim:
      fail(fn, f"{name} must have rank {ndim}{want}, has shape {list(x_shape)}", shown)
    if x_shape != ref_shape:
      if shape is not None:
        fail(fn, f"shape mismatch: {name} has shape {list(x_shape)}, must be{want} = {list(ref_shape)}", shown)
      fail(fn, f"shape mismatch: {name} has shape {list(x_shape)}, must match {ref_name} {list(ref_shape)}", shown)
    dtype = getattr(x, "dtype", None)
    dtype = jnp.asarray(x).dtype if dtype is None else jnp.dtype(dtype)
    if name in masks:
      if not is_mask_dtype(dtype):
        fail(fn, f"{name} must be bool, integer or float32/float64, is {dtype.name}", shown)
    elif dtype not in (jnp.float32, jnp.float64):
      fail(fn, f"dtype mismatch: {name} is {dtype.name}, expected float32 (or float64)", shown)
    dtypes.append(dtype)
  return [as_compute(x, d) for x, d in zip(arrays.values(), dtypes)]
