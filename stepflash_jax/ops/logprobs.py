"""Token log-probabilities, log-sum-exp and entropy of an LM head without materialising [N, V] logits.

For hidden states h [N, H], head weight W [H, V] and targets y [N] (all results fp32):
  z      = h W                                  logits, [N, V]
  lse    = log sum_v exp(z_v)
  logp   = z_y - lse                            log-probability of the target token
  ent    = lse - sum_v p_v z_v,  p = softmax(z)  entropy of the next-token distribution

Implementations (``implementation=``):
  "reference"  the full [N, V] fp32 logits, then log_softmax (what SFT, scoring and the losses did before).
  "chunked"    a scan over vocabulary chunks of `chunk_size` columns (the last one padded) with an online
               (max-shifted) accumulation
               m = running max, s = sum exp(z - m), t = sum exp(z - m) z, plus the target's logit; lse = m + log s,
               ent = lse - t / s. custom_vjp: the backward pass recomputes each chunk's logits and forms
                 dz = g_logp (onehot(y) - p) + g_lse p - g_ent p (z - E_p[z])
               chunk by chunk (dh += dz W_c^T, dW_c = h^T dz), so both passes hold one [N, chunk] block at a time.
Peak memory: reference O(N V), chunked O(N chunk) (plus h, W and their gradients).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.masks import MASK_VALUE
from stepflash_jax.checks import is_int

IMPLEMENTATIONS = ("reference", "chunked")
DEFAULT_CHUNK = 8192  # columns per block: 8192 x 4096 tokens x 4 bytes = 128 MiB per block at the real sizes


def _check(hidden, weight, targets, chunk_size):
  if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[0]:
    raise ValueError(f"token_logprobs: need hidden [N, H] and weight [H, V], got {hidden.shape} and {weight.shape}")
  if targets.shape != hidden.shape[:1] or not jnp.issubdtype(targets.dtype, jnp.integer):
    raise ValueError(f"token_logprobs: targets must be integer [N] = [{hidden.shape[0]}], got {targets.shape}")
  if not is_int(chunk_size) or chunk_size <= 0:
    raise ValueError(f"token_logprobs: chunk_size must be a positive int, got {chunk_size!r}")


def _logits(hidden, weight):
  return jnp.dot(hidden, weight, preferred_element_type=jnp.float32)


def reference_token_logprobs(hidden, weight, targets):
  """The full-logits computation: (logp [N], lse [N], entropy [N]), fp32."""
  z = _logits(hidden, weight)
  lse = jax.nn.logsumexp(z, axis=-1)
  logp = jnp.take_along_axis(z, targets[:, None], axis=-1)[:, 0] - lse
  p = jnp.exp(z - lse[:, None])
  return logp, lse, lse - jnp.sum(p * z, axis=-1)


def _chunks(weight, chunk_size):
  """[H, V] -> ([C, H, chunk] the scan's xs, zero columns padding V up to C * chunk; [C] first column of each)."""
  H, V = weight.shape
  C = -(-V // chunk_size)
  w = jnp.pad(weight, ((0, 0), (0, C * chunk_size - V)))
  return w.reshape(H, C, chunk_size).transpose(1, 0, 2), jnp.arange(C, dtype=jnp.int32) * chunk_size


def _chunk_logits(hidden, w, start, vocab):
  """Logits of one chunk [N, chunk], the padding columns (index >= vocab) at MASK_VALUE: exp() = 0, and
  0 * MASK_VALUE stays finite."""
  col = start + jnp.arange(w.shape[1], dtype=jnp.int32)
  return jnp.where(col[None, :] < vocab, _logits(hidden, w), MASK_VALUE)


def _forward(hidden, weight, targets, chunk_size):
  N, V = hidden.shape[0], weight.shape[1]

  def body(carry, xs):
    m, s, t, zy = carry
    w, start = xs
    z = _chunk_logits(hidden, w, start, V)  # [N, chunk]
    m_new = jnp.maximum(m, z.max(-1))
    scale = jnp.exp(m - m_new)
    e = jnp.exp(z - m_new[:, None])
    col = targets - start
    inside = (col >= 0) & (col < chunk_size)
    zy = zy + jnp.where(inside, jnp.take_along_axis(z, jnp.clip(col, 0, chunk_size - 1)[:, None], -1)[:, 0], 0.0)
    return (m_new, s * scale + e.sum(-1), t * scale + (e * z).sum(-1), zy), None

  zeros = jnp.zeros((N,), jnp.float32)
  init = (jnp.full((N,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
  (m, s, t, zy), _ = jax.lax.scan(body, init, _chunks(weight, chunk_size))
  lse = m + jnp.log(s)
  return zy - lse, lse, lse - t / s


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked(hidden, weight, targets, chunk_size):
  return _forward(hidden, weight, targets, chunk_size)


def _chunked_fwd(hidden, weight, targets, chunk_size):
  out = _forward(hidden, weight, targets, chunk_size)
  return out, (hidden, weight, targets, out[1], out[1] - out[2])  # lse and E_p[z] = lse - entropy


def _chunked_bwd(chunk_size, res, g):
  hidden, weight, targets, lse, mean_z = res
  g_logp, g_lse, g_ent = (x.astype(jnp.float32) for x in g)
  H, V = weight.shape

  def body(dh, xs):
    w, start = xs
    z = _chunk_logits(hidden, w, start, V)
    p = jnp.exp(z - lse[:, None])
    onehot = (targets - start)[:, None] == jnp.arange(chunk_size, dtype=targets.dtype)[None, :]
    dz = g_logp[:, None] * (onehot - p) + g_lse[:, None] * p - g_ent[:, None] * p * (z - mean_z[:, None])
    dh = dh + jnp.dot(dz, w.astype(jnp.float32).T)
    return dh, jnp.dot(hidden.astype(jnp.float32).T, dz)  # dW chunk [H, chunk]

  dh, dw = jax.lax.scan(body, jnp.zeros(hidden.shape, jnp.float32), _chunks(weight, chunk_size))
  dw = dw.transpose(1, 0, 2).reshape(H, -1)[:, :V]
  return dh.astype(hidden.dtype), dw.astype(weight.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def token_logprobs(hidden, weight, targets, *, implementation: str = "chunked", chunk_size: int | None = None):
  """hidden [N, H], weight [H, V], targets int [N] -> (logp [N], lse [N], entropy [N]) fp32 (module docstring).

  chunk_size (chunked): columns per block (default min(V, 8192)); the last block is padded when it does not divide V.
  Differentiable in hidden and weight.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"token_logprobs: implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  chunk = min(weight.shape[1], DEFAULT_CHUNK) if chunk_size is None else chunk_size
  _check(hidden, weight, targets, chunk)
  if implementation == "reference":
    return reference_token_logprobs(hidden, weight, targets)
  return _chunked(hidden, weight, targets.astype(jnp.int32), chunk)
