"""stepflash_jax.rl.routing.routing_confidence against a NumPy loop."""

import jax
import numpy as np
import pytest

from stepflash_jax.rl import routing

F32 = np.float32


def np_sigma(logits, idx, mask, score_fn):
  L, B, T, E = logits.shape
  per_layer = np.zeros(L)
  for l in range(L):
    tot, n = 0.0, 0
    for b in range(B):
      for t in range(T):
        if not mask[b, t]:
          continue
        z = logits[l, b, t].astype(np.float64)
        if score_fn == "softmax":
          p = np.exp(z - z.max())
        else:
          p = 1 / (1 + np.exp(-z)) if score_fn == "sigmoid" else z
        p = p / p.sum()
        tot += sum(p[e] for e in idx[l, b, t])
        n += 1
    per_layer[l] = tot / max(n, 1)
  return per_layer


@pytest.fixture
def data():
  rng = np.random.RandomState(0)
  L, B, T, E, k = 3, 2, 5, 16, 4
  logits = rng.normal(0, 2, (L, B, T, E)).astype(F32)
  bias = rng.normal(0, 0.5, E)
  idx = np.argsort(-(1 / (1 + np.exp(-logits)) + bias), axis=-1)[..., :k].astype(np.int32)  # biased selection
  mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], F32)
  return logits, idx, mask


@pytest.mark.parametrize("score_fn", ["sigmoid", "softmax", "scores"])
def test_matches_numpy(data, score_fn):
  logits, idx, mask = data
  if score_fn == "scores":
    logits = np.abs(logits)
  per_layer, mean, tok = routing.routing_confidence(logits, idx, mask, score_fn=score_fn, per_token=True)
  ref = np_sigma(logits, idx, mask, score_fn)
  np.testing.assert_allclose(per_layer, ref, rtol=1e-5)
  np.testing.assert_allclose(mean, ref.mean(), rtol=1e-5)
  assert tok.shape == (3, 2, 5) and np.all(np.asarray(tok)[:, mask == 0] == 0)


def test_garbage_at_masked_tokens_and_full_k(data):
  logits, idx, mask = data
  g = logits.copy()
  g[:, mask == 0] = 1e30
  f = jax.jit(routing.routing_confidence, static_argnames=("score_fn",))
  np.testing.assert_array_equal(f(logits, idx, mask)[0], f(g, idx, mask)[0])
  E = logits.shape[-1]
  all_idx = np.broadcast_to(np.arange(E, dtype=np.int32), logits.shape)
  per_layer, mean = routing.routing_confidence(logits, all_idx, mask)  # k = E: all mass chosen
  np.testing.assert_allclose(per_layer, 1.0, rtol=1e-6)
  _, mean0 = routing.routing_confidence(logits, idx, np.zeros_like(mask))  # no valid token: finite 0
  assert float(mean0) == 0.0


def test_bad_inputs_raise(data):
  logits, idx, mask = data
  with pytest.raises(ValueError, match=r"router_logits is bfloat16, expected float32"):
    routing.routing_confidence(logits.astype(jax.numpy.bfloat16), idx, mask)
  with pytest.raises(ValueError, match=r"router_logits must have rank 4 \[L, B, T, E\], has shape \[2, 5, 16\]"):
    routing.routing_confidence(logits[0], idx, mask)
  msg = r"topk_idx must be \[L, B, T, k\] = \[3, 2, 5, k\].*topk_idx int32\[2, 2, 5, 4\]"
  with pytest.raises(ValueError, match=msg):
    routing.routing_confidence(logits, idx[:2], mask)
  with pytest.raises(ValueError, match=r"topk_idx must be integer, is float32"):
    routing.routing_confidence(logits, idx.astype(F32), mask)
  with pytest.raises(ValueError, match=r"mask has shape \[2, 4\], must be \[B, T\] = \[2, 5\]"):
    routing.routing_confidence(logits, idx, mask[:, :4])
  with pytest.raises(ValueError, match="score_fn"):
    routing.routing_confidence(logits, idx, mask, score_fn="relu")
