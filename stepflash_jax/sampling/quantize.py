"""Weight-quantized rollouts (docs/rl.md §8): the numerics of a W8A16 inference engine, a common way production RL
stacks speed up generation, and a source of train/inference mismatch larger than bf16 rounding.

Every weight matrix the engine multiplies with (attention, dense and shared-expert FFNs, each routed expert, MTP
projections) is quantized per output channel and dequantized before the matmul:

    scale_c = max_r |W[r, c]| / Q          r over the matrix's input (reduction) axes, Q = 127 (int8) or 448 (fp8)
    W'[r, c] = q(W[r, c] / scale_c) * scale_c,   q = round-to-nearest int8 in [-127, 127] | float8 e4m3 rounding

The input axes of each parameter are the matrix view Muon uses (`optim.muon.param_dims`; experts: one matrix per
expert). The embedding, the output heads and the router stay unquantized, as in common fp8 / int8 serving setups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stepflash_jax.optim.muon import param_dims

QUANT_FORMATS = {"int8": 127.0, "fp8": 448.0}  # largest representable magnitude: symmetric int8, float8_e4m3fn


def fake_quantize(w, fmt: str, reduction_axes) -> jax.Array:
  """w (any float dtype) -> float32 W' (module docstring) with one scale per output channel."""
  if fmt not in QUANT_FORMATS:
    raise ValueError(f"quantize must be one of {tuple(QUANT_FORMATS)}, got {fmt!r}")
  w32 = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=tuple(reduction_axes), keepdims=True)
  scale = jnp.where(amax > 0, amax / QUANT_FORMATS[fmt], 1.0)
  x = w32 / scale
  q = jnp.clip(jnp.round(x), -127, 127) if fmt == "int8" else x.astype(jnp.float8_e4m3fn).astype(jnp.float32)
  return q * scale


def quantize_params(params, fmt: str):
  """Every matrix of `params` but the embedding, heads and routers fake-quantized (float32); other leaves as given."""

  def f(path, x):
    names = [str(getattr(p, "key", "")) for p in path]
    dims = param_dims(names, x.shape)
    if names[-1] != "kernel" or "router" in names or dims is None:
      return x
    return fake_quantize(x, fmt, dims.reduction_axes)

  return jax.tree_util.tree_map_with_path(f, params)
