"""Rotary position embedding, NeoX rotate-half, on the first `rotary_dim` dims of each head (partial rotary).

The inverse frequencies (incl. llama3-type scaling for full-attention layers) are computed statically from the
config by `stepflash_jax.config.rope_inv_freq`; here they are applied.
"""

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
  """x [B, T, H, D], positions [B, T] int, inv_freq (rotary_dim/2,) -> same shape/dtype as x.

  With r = rotary_dim: x[..., :r] = (x1, x2) halves; out = x*cos + rotate_half(x)*sin, rotate_half = (-x2, x1);
  dims r..D pass through unchanged. Angles and products in fp32.
  """
  inv = jnp.asarray(inv_freq, jnp.float32)
  r = 2 * inv.shape[0]
  ang = positions.astype(jnp.float32)[..., None] * inv  # [B, T, r/2]
  cos = jnp.cos(jnp.concatenate([ang, ang], -1))[:, :, None, :]  # [B, T, 1, r]
  sin = jnp.sin(jnp.concatenate([ang, ang], -1))[:, :, None, :]
  xr = x[..., :r].astype(jnp.float32)
  x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
  out = xr * cos + jnp.concatenate([-x2, x1], -1) * sin
  return jnp.concatenate([out.astype(x.dtype), x[..., r:]], -1)
