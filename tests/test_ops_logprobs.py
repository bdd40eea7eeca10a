"""ops.token_logprobs: the vocabulary-chunked log-prob / log-sum-exp / entropy against the full-logits reference,
values and gradients (fp32, 1e-6 relative), edge cases and bad arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stepflash_jax.ops.logprobs import reference_token_logprobs, token_logprobs


def _data(n=12, h=16, v=64, scale=1.0, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  hidden = jax.random.normal(k1, (n, h), jnp.float32)
  weight = scale * jax.random.normal(k2, (h, v), jnp.float32) / np.sqrt(h)
  targets = jax.random.randint(k3, (n,), 0, v)
  return hidden, weight, targets


def _numpy(hidden, weight, targets):  # independent float64 reference
  z = np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64)
  lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
  p = np.exp(z - lse[:, None])
  return z[np.arange(len(z)), np.asarray(targets)] - lse, lse, lse - (p * z).sum(-1)


@pytest.mark.parametrize("chunk", [8, 24, 64, 100])  # 24: V = 64 is not a multiple; 100: one padded chunk
@pytest.mark.parametrize("scale", [1.0, 30.0])  # 30: peaked distributions, logits far from 0
def test_values_match_the_full_computation(chunk, scale):
  hidden, weight, targets = _data(scale=scale)
  got = token_logprobs(hidden, weight, targets, chunk_size=chunk)
  for g, r, name in zip(got, _numpy(hidden, weight, targets), ("logp", "lse", "entropy")):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-5 * max(1.0, scale), err_msg=name)


def test_targets_at_the_chunk_edges():
  hidden, weight, _ = _data(n=6, v=32)
  targets = jnp.array([0, 7, 8, 15, 16, 31])  # first / last column of chunks of 8
  np.testing.assert_allclose(
    token_logprobs(hidden, weight, targets, chunk_size=8)[0], _numpy(hidden, weight, targets)[0], rtol=1e-6
  )


def test_gradients_match_the_full_computation():
  hidden, weight, targets = _data()
  gl, ge, gz = jax.random.normal(jax.random.key(5), (3, hidden.shape[0]))

  def objective(fn):
    def f(h, w):
      logp, lse, ent = fn(h, w)
      return jnp.sum(gl * logp + gz * lse + ge * ent)

    return jax.grad(f, argnums=(0, 1))

  want = objective(lambda h, w: reference_token_logprobs(h, w, targets))(hidden, weight)
  got = jax.jit(objective(lambda h, w: token_logprobs(h, w, targets, chunk_size=24)))(hidden, weight)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_bad_arguments_name_the_problem():
  hidden, weight, targets = _data()
  with pytest.raises(ValueError, match="chunk_size must be a positive int, got -8"):
    token_logprobs(hidden, weight, targets, chunk_size=-8)
  with pytest.raises(ValueError, match="targets must be integer"):
    token_logprobs(hidden, weight, targets.astype(jnp.float32))
  with pytest.raises(ValueError, match="hidden \\[N, H\\] and weight \\[H, V\\]"):
    token_logprobs(hidden, weight.T, targets)
  with pytest.raises(ValueError, match="implementation must be one of"):
    token_logprobs(hidden, weight, targets, implementation="pallas")
