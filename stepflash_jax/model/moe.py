"""Mixture of experts FFN (docs/architecture.md §5): sigmoid router in fp32, bias-for-selection-only, shared expert.

  s = sigmoid(x W_router)                         [N, E], fp32
  chosen = top_k(s + router_bias)                 router_bias: collection "router", not trained by gradients
  w = s[chosen] / sum(s[chosen]) * routed_scaling_factor     (the *unbiased* scores, renormalised)
  y = sum_k w_k * Expert_{chosen_k}(x) + SharedExpert(x)      (shared expert always on, unscaled)

Dropless: tokens are sorted by expert and the experts run as grouped matmuls (`ops.grouped_matmul`), whose cost
scales with the routed rows, not with the number of experts. Under parallel.use_mesh with expert_parallel set
(ModelArgs.expert_parallel, e.g. "auto") the routed experts run expert-parallel in a shard_map instead
(model/moe_parallel.py: same result, tokens exchanged between the devices holding their experts).
Statistics for load balancing and routing confidence are sown into the "moe_stats" collection
(`apply(..., mutable=["moe_stats"])`).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from stepflash_jax.model import moe_parallel
from stepflash_jax.model.mlp import MLP, Weight, expert_ffn


def route(x, router_kernel, router_bias, top_k: int, scaling: float, renormalize: bool = True, replay=None):
  """x [N, H] -> (scores [N, E] fp32, chosen [N, k] int32, weights [N, k] fp32).

  replay [N, k] int (router replay, model/replay.py): these experts are chosen instead of top_k(s + bias); the
  weights are still the current scores of the chosen experts (differentiable in the router weights)."""
  logits = jnp.dot(x.astype(jnp.float32), router_kernel.astype(jnp.float32), precision="highest")
  scores = jax.nn.sigmoid(logits)
  if replay is None:
    _, chosen = jax.lax.top_k(scores + router_bias.astype(jnp.float32), top_k)
  else:
    chosen = replay
  w = jnp.take_along_axis(scores, chosen, axis=-1)
  if renormalize:
    w = w / (jnp.sum(w, -1, keepdims=True) + 1e-20)
  return scores, chosen.astype(jnp.int32), w * scaling


def normalized_scores(scores):
  """Routing probabilities over all experts from nonnegative scores [..., E]: p = s / sum_e s (fp32)."""
  s = scores.astype(jnp.float32)
  return s / jnp.maximum(jnp.sum(s, -1, keepdims=True), jnp.finfo(jnp.float32).tiny)


def chosen_mass(p, chosen):
  """Routing confidence Sigma_k per token: the probability mass sum_j p[..., chosen[..., j]] of the chosen experts."""
  return jnp.take_along_axis(p, chosen.astype(jnp.int32), axis=-1, mode="clip").sum(-1)


class MoE(nn.Module):
  hidden: int
  num_experts: int
  top_k: int
  width: int
  shared_width: int
  routed_scaling_factor: float = 3.0
  renormalize: bool = True
  init_std: float = 0.02
  implementation: str = "xla"
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  # Expert parallelism (model/moe_parallel.py): "none" | "auto" | "gather" | "a2a" | "ragged" (":<cf>");
  # None = ModelArgs.expert_parallel of the enclosing decoder layer. Only used under parallel.use_mesh.
  expert_parallel: str | None = None

  def _ep_mode(self) -> str:
    if self.expert_parallel is not None:
      return self.expert_parallel
    return getattr(getattr(self.parent, "args", None), "expert_parallel", "none")

  @nn.compact
  def __call__(self, x, token_mask=None, limit=0.0, shared_limit=0.0, replay=None):
    """x [B, T, H], token_mask [B, T] (1 = real token; statistics only), replay [B, T, k] int32 experts to use
    instead of the router's top-k (router replay) -> [B, T, H]."""
    B, T, H = x.shape
    E, F = self.num_experts, self.width
    kw = dict(init_std=self.init_std, dtype=self.dtype, param_dtype=self.param_dtype)
    router = Weight(
      (H, E), ("embed", "expert"), name="router", init_std=self.init_std, dtype=jnp.float32, param_dtype=jnp.float32
    )()
    bias = self.variable(
      "router", "router_bias", nn.with_logical_partitioning(lambda: jnp.zeros((E,), jnp.float32), ("expert",))
    )
    wg = Weight((E, H, F), ("expert", "embed", "mlp"), name="gate_proj", **kw)()
    wu = Weight((E, H, F), ("expert", "embed", "mlp"), name="up_proj", **kw)()
    wd = Weight((E, F, H), ("expert", "mlp", "embed"), name="down_proj", **kw)()

    xf = x.reshape(B * T, H).astype(self.dtype)
    rep = None if replay is None else replay.reshape(B * T, self.top_k)
    scores, chosen, w = route(xf, router, bias.value, self.top_k, self.routed_scaling_factor, self.renormalize, rep)
    mode = self._ep_mode()
    if moe_parallel.active(mode):  # tokens travel to the devices holding their experts (shard_map)
      y = moe_parallel.moe_experts(xf, chosen, w, wg, wu, wd, limit, mode=mode, implementation=self.implementation)
    else:
      y = expert_ffn(xf, chosen, wg, wu, wd, limit, self.implementation)
      y = jnp.einsum("nkh,nk->nh", y.astype(jnp.float32), w)
    y = y.astype(self.dtype).reshape(B, T, H)
    y = y + MLP(H, self.shared_width, name="shared", **kw)(x, shared_limit)

    # Statistics over real tokens (fp32): expert load, mean routing probability, routing confidence Sigma_k
    # = probability mass (scores normalised over all experts) of the chosen experts.
    m = jnp.ones((B * T,), jnp.float32) if token_mask is None else token_mask.reshape(-1).astype(jnp.float32)
    prob = normalized_scores(scores)
    n = jnp.maximum(m.sum(), 1.0)
    self.sow("moe_stats", "load", jnp.zeros((E,), jnp.float32).at[chosen.reshape(-1)].add(jnp.repeat(m, self.top_k)))
    self.sow("moe_stats", "prob_mean", (prob * m[:, None]).sum(0) / n)
    conf = chosen_mass(prob, chosen) * m
    self.sow("moe_stats", "confidence", conf.sum() / n)
    self.sow("moe_stats", "tokens", m.sum())
    # per token [B, T] (0 on padding): lets a caller average Sigma_k over a subset, e.g. the RL response tokens
    self.sow("moe_stats", "confidence_per_token", conf.reshape(B, T))
    self.sow("moe_stats", "expert_ids", chosen.reshape(B, T, self.top_k))  # what router replay feeds back
    return y


def update_router_bias(router, stats, rate: float):
  """Aux-loss-free balancing (docs/training.md §3): bias_e += rate * sign(mean_load - load_e), per MoE layer.

  `router` is the "router" collection, `stats` the sown "moe_stats" tree of the same step (same module paths).
  """

  def walk(r, s):
    if "router_bias" in r:
      load = s["load"][0]
      return {**r, "router_bias": r["router_bias"] + rate * jnp.sign(load.mean(-1, keepdims=True) - load)}
    return {k: walk(v, s[k]) for k, v in r.items()}

  return walk(router, stats)


def ep_balance_loss(stats, groups: int, top_k: int):
  """EP-group balance loss (docs/training.md §3), mean over MoE layers: G * sum_g (sum_{e in g} f_e)(sum_{e in g} p_e),
  f_e = fraction of the top-k slots given to e, p_e = mean routing probability of e. Differentiable through p."""
  losses = []

  def walk(s):
    if "load" in s:
      load, p = s["load"][0], s["prob_mean"][0]  # [..., E]
      f = load / jnp.maximum(load.sum(-1, keepdims=True), 1.0)
      fg = f.reshape(f.shape[:-1] + (groups, -1)).sum(-1)
      pg = p.reshape(p.shape[:-1] + (groups, -1)).sum(-1)
      losses.append((groups * (fg * pg).sum(-1)).reshape(-1))
    else:
      for v in s.values():
        if isinstance(v, dict):
          walk(v)

  walk(stats)
  return jnp.concatenate(losses).mean() if losses else jnp.float32(0)


def routing_metrics(stats, router) -> dict:
  """Per MoE layer and averaged over layers (fp32 scalars): routing confidence Sigma_k ("routing/confidence"),
  expert-load imbalance max_e load_e / mean_e load_e ("routing/load_imbalance"; 1 = perfectly balanced) and the
  L2 norm of the selection bias ("routing/bias_norm"). stats: the sown "moe_stats" tree; router: the "router"
  collection (the bias after this step's update)."""
  per = {
    "confidence": stat_layers(stats, "confidence"),
    "load_imbalance": {
      k: v.max() / jnp.maximum(v.mean(), 1e-9) for k, v in stat_layers(stats, "load", vector=True).items()
    },
    "bias_norm": {k: jnp.linalg.norm(v) for k, v in stat_layers(router, "router_bias", vector=True).items()},
  }
  out = {}
  for stat, layers in per.items():
    if layers:
      out[f"routing/{stat}"] = jnp.stack(list(layers.values())).mean()
      out.update({f"routing/{stat}/{k}": v for k, v in layers.items()})
  return out


def stat_layers(tree, name: str = "confidence", vector: bool = False) -> dict:
  """{MoE layer: value} of leaf `name` of a sown "moe_stats" tree (or of the "router" collection), keyed by the
  module path ("layer_3"; scanned stacks get one entry per block, "<path>[i]"; MTP modules are included when they
  were called). Scalars per layer by default; vector=True keeps the last axis (per-expert "load", "router_bias")."""
  out = {}
  for path, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))[0]:
    keys = [str(getattr(k, "key", k)) for k in path]
    if keys[-1] != name:
      continue
    where = "/".join(k for k in keys[:-1] if k not in ("moe", "mlp"))
    x = v[0] if isinstance(v, tuple) else v
    rows = x.reshape(-1, x.shape[-1]) if vector else x.reshape(-1)
    out.update({where: rows[0]} if rows.shape[0] == 1 else {f"{where}[{i}]": rows[i] for i in range(rows.shape[0])})
  return out


def stat_mean(stats, name: str = "confidence"):
  """Mean of a scalar MoE statistic over all MoE layers of a sown "moe_stats" tree (e.g. routing confidence)."""
  vals = list(stat_layers(stats, name).values())
  return jnp.stack(vals).mean() if vals else jnp.float32(jnp.nan)
