"""SwiGLU feed-forward with the optional clamp of STEP35.md §1 (dense FFN and the MoE shared expert).

Clamped SwiGLU: y = (min(silu(x W_gate), L) * clip(x W_up, -L, L)) W_down; L = 0 means no clamp.
"""

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit) -> jax.Array:
  """Elementwise activation in fp32; `limit` is a Python float or a traced scalar (0 = no clamp)."""
  g = jax.nn.silu(gate.astype(jnp.float32))
  u = up.astype(jnp.float32)
  if isinstance(limit, (int, float)) and limit <= 0:
    return g * u
  lim = jnp.asarray(limit, jnp.float32)
  lim = jnp.where(lim > 0, lim, jnp.inf)
  return jnp.minimum(g, lim) * jnp.clip(u, -lim, lim)


class Weight(nn.Module):
  """One weight leaf named `kernel`, with logical axis names; returned cast to `dtype`."""

  shape: Sequence[int]
  axes: Sequence[str]
  init_std: float = 0.02
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  zero_init: bool = False

  @nn.compact
  def __call__(self):
    init = nn.initializers.zeros_init() if self.zero_init else nn.initializers.normal(stddev=self.init_std)
    w = self.param("kernel", nn.with_logical_partitioning(init, tuple(self.axes)), tuple(self.shape), self.param_dtype)
    return w.astype(self.dtype)


class MLP(nn.Module):
  """x [B, T, H] -> [B, T, H]; gate_proj/up_proj [H, I], down_proj [I, H] (kernels are [in, out])."""

  hidden: int
  width: int
  init_std: float = 0.02
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, limit=0.0):
    kw = dict(init_std=self.init_std, dtype=self.dtype, param_dtype=self.param_dtype)
    wg = Weight((self.hidden, self.width), ("embed", "mlp"), name="gate_proj", **kw)()
    wu = Weight((self.hidden, self.width), ("embed", "mlp"), name="up_proj", **kw)()
    wd = Weight((self.width, self.hidden), ("mlp", "embed"), name="down_proj", **kw)()
    x = x.astype(self.dtype)
    h = clamped_swiglu(x @ wg, x @ wu, limit).astype(self.dtype)
    h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
    return h @ wd
