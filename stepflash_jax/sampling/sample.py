"""Sampling: temperature, top-p nucleus and logit noise -> (token, log-prob under the sampled distribution)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def sampling_logprobs(logits, temperature, top_p):
  """logits [..., V] -> fp32 log-probs [..., V] of softmax(logits / T) restricted to the top-p nucleus (the
  smallest set of most likely tokens with mass >= top_p; ties at the boundary kept), renormalised.
  temperature <= 0 (greedy) uses T = 1, top_p >= 1 skips the nucleus."""
  t = jnp.where(temperature > 0, temperature, 1.0)
  lp = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)

  def nucleus(lp):
    srt = -jnp.sort(-lp, axis=-1)
    before = jnp.cumsum(jnp.exp(srt), -1) - jnp.exp(srt)  # mass of the more likely tokens
    thresh = jnp.min(jnp.where(before < top_p, srt, jnp.inf), -1, keepdims=True)
    return jax.nn.log_softmax(jnp.where(lp >= thresh, lp, -jnp.inf), -1)

  return lax.cond(top_p < 1.0, nucleus, lambda x: x, lp)


def noisy(key, logits, std):
  return lax.cond(
    std > 0, lambda l: l + std * jax.random.normal(key, l.shape, jnp.float32), lambda l: l, logits.astype(jnp.float32)
  )


def draw(key, lp, greedy):
  """lp [..., V] -> (token [...] int32, its log-prob [...])."""
  tok = jnp.where(greedy, jnp.argmax(lp, -1), jax.random.categorical(key, lp, -1)).astype(jnp.int32)
  return tok, jnp.take_along_axis(lp, tok[..., None], -1)[..., 0]


def is_stop(tok, stop_ids):
  """tok int [...] -> bool [...]: tok is one of the stop tokens (stop_ids: an int32 scalar or [S])."""
  return jnp.any(tok[..., None] == jnp.reshape(stop_ids, (-1,)), axis=-1)
