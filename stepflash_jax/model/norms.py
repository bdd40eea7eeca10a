"""Zero-centred RMSNorm (docs/architecture.md §4): y = x * rsqrt(mean(x^2) + eps) * (1 + w), w initialised to 0,
computed in fp32."""

import flax.linen as nn
import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """x [..., D], scale [D] -> float32 [..., D]."""
  x = x.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return y * (1.0 + scale.astype(jnp.float32))


class RMSNorm(nn.Module):
  """Normalises the last axis in fp32 and returns `dtype` (default float32)."""

  eps: float = 1e-5
  axis_name: str = "embed"
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param(
      "scale",
      nn.with_logical_partitioning(nn.initializers.zeros_init(), (self.axis_name,)),
      (x.shape[-1],),
      self.param_dtype,
    )
    return rms_norm(x, scale, self.eps).astype(self.dtype)
