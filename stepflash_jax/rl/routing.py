"""Routing confidence Sigma_k (docs/rl.md §8): the average probability mass of the activated experts.

Per MoE layer l and token (b, t): p = the routing distribution over all E experts, Sigma = sum of p over the k
chosen experts; averaged over valid tokens per layer, then over layers. Low Sigma_k predicts unstable off-policy
RL on a MoE model (router replay or strictly on-policy updates are then needed).

Input convention (stack the model's per-MoE-layer router outputs along a leading axis):
  router_logits  float32 [L, B, T, E]  the router's pre-activation logits (fp32 router), L = number of MoE layers
  topk_idx       integer [L, B, T, k]  the experts actually activated (Step selects top-k of s + router_bias);
                                        entries in [0, E), distinct within a token
  mask           [B, T] bool/integer/float32, nonzero on tokens to average over (e.g. valid response tokens)
Routing probabilities from the logits, per ``score_fn``:
  "sigmoid" (Step 3.5 Flash): s = sigmoid(logits), p = s / sum_e s   (the *unbiased* scores; router_bias is
             only used for selection and does not enter p)
  "softmax": p = softmax(logits)
  "scores":  the first argument already holds nonnegative scores s (e.g. sigmoid outputs); p = s / sum_e s
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stepflash_jax.model.moe import chosen_mass, normalized_scores
from stepflash_jax.rl.checks import check_arrays, fail

SCORE_FNS = ("sigmoid", "softmax", "scores")


def routing_probs(router_logits, score_fn="sigmoid"):
  """[..., E] float32 -> routing probabilities over all experts [..., E] (see module docstring)."""
  if score_fn not in SCORE_FNS:
    raise ValueError(f"routing_probs: score_fn must be one of {SCORE_FNS}, got {score_fn!r}")
  z = jnp.asarray(router_logits, jnp.float32)
  if score_fn == "softmax":
    return jax.nn.softmax(z, axis=-1)
  return normalized_scores(jax.nn.sigmoid(z) if score_fn == "sigmoid" else z)


def routing_confidence(router_logits, topk_idx, mask, score_fn="sigmoid", per_token=False):
  """Sigma_k per MoE layer and averaged over layers.

  Args: router_logits float32 [L, B, T, E]; topk_idx integer [L, B, T, k]; mask [B, T] (module docstring).
  Returns (per_layer float32 [L], mean float32 scalar), where per_layer[l] = sum_{b,t} mask * sum_{j<k}
    p[l, b, t, topk_idx[l, b, t, j]] / max(#valid, 1) and mean = mean_l per_layer[l] (equal to the average over
    all (layer, valid token) pairs). With per_token=True also the per-token Sigma [L, B, T] (0 where masked).
  """
  fn = "routing_confidence"
  shown = {"router_logits": router_logits, "topk_idx": topk_idx, "mask": mask}
  (router_logits,) = check_arrays(
    fn, {"router_logits": router_logits}, ndim=4, masks=(), expect="[L, B, T, E]", context=shown
  )
  L, B, T, E = router_logits.shape
  if jnp.ndim(topk_idx) != 4 or tuple(jnp.shape(topk_idx)[:3]) != (L, B, T):
    fail(fn, f"topk_idx must be [L, B, T, k] = [{L}, {B}, {T}, k]", shown)
  topk_idx = jnp.asarray(topk_idx)
  if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
    fail(fn, f"topk_idx must be integer, is {topk_idx.dtype.name}", shown)
  if not 1 <= topk_idx.shape[-1] <= E:
    fail(fn, f"topk_idx must choose 1 <= k <= E = {E} experts, has k = {topk_idx.shape[-1]}", shown)
  (mask,) = check_arrays(fn, {"mask": mask}, shape=(B, T), expect="[B, T]", context=shown)
  valid = mask != 0
  z = jnp.where(valid[None, :, :, None], router_logits, 0.0)  # garbage at masked tokens never matters
  p = routing_probs(z, score_fn)
  sigma = chosen_mass(p, topk_idx)  # [L, B, T]: the same rule as the statistic the MoE layer sows
  sigma = jnp.where(valid[None], sigma, 0.0)
  per_layer = sigma.sum((1, 2)) / jnp.maximum(valid.sum(), 1).astype(jnp.float32)
  mean = per_layer.mean()
  return (per_layer, mean, sigma) if per_token else (per_layer, mean)
