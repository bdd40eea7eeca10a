"""The update machinery shared by SFT and RL: learning-rate schedule, optimizer, frozen-parameter mask, the guarded
(non-finite-skipping) update, and the eval / log / checkpoint cadence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from stepflash_jax.optim import muon


def lr_schedule(peak: float, total_steps: int, warmup_frac: float = 0.03, end_frac: float = 0.5):
  """Linear warmup over warmup_frac of the steps, then cosine from peak to end_frac * peak (1e-5 -> 5e-6)."""
  warmup = max(1, int(round(warmup_frac * total_steps)))
  return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1), end_frac * peak)


def warmup_constant(lr: float, warmup: int):
  """RL schedule: linear warmup (lr * (n + 1) / warmup for update n) to a constant lr."""
  return lambda count: lr * jnp.minimum(1.0, (count + 1) / max(warmup, 1))


def make_optimizer(ocfg, lr) -> optax.GradientTransformation:
  """Muon (Polar Express, fp16) for matrices + AdamW for embeddings/heads/1-D params; grad clip by global norm."""
  return muon(
    lr,
    method=ocfg.muon_method,
    ortho_dtype=ocfg.ortho_dtype,
    weight_decay=ocfg.weight_decay,
    grad_clip_norm=ocfg.grad_clip,
    pe_safety=ocfg.get("pe_safety", "reference"),
  )


def frozen_mask(params, freeze_router: bool, router_lr_scale: float = 1.0):
  """Per-leaf update scale: 1.0 for trainable leaves; for the router weights 0.0 when frozen (their update, incl.
  decay, is zeroed), else router_lr_scale (their learning rate relative to the rest)."""

  def m(path, _):
    names = [getattr(p, "key", "") for p in path]
    if "router" not in names:
      return 1.0
    return 0.0 if freeze_router else float(router_lr_scale)

  return jax.tree_util.tree_map_with_path(m, params)


def guarded_update(state, grads, loss, tx, mask):
  """Apply tx unless the loss or a gradient is non-finite; returns (new params, new opt state, grad norm, skipped).

  Frozen leaves (mask 0) take no part: their gradients are zeroed first, so they count neither in the reported
  norm, nor in tx's global-norm clip, nor in the non-finite check; their update (incl. weight decay) is zeroed."""
  grads = jax.tree.map(lambda g, m: jnp.where(m > 0, g, 0.0), grads, mask)
  gnorm = optax.global_norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
  grads = jax.tree.map(lambda g: jnp.where(ok, g, 0.0), grads)
  updates, opt = tx.update(grads, state["opt"], state["params"])
  updates = jax.tree.map(lambda u, m: u * m, updates, mask)
  params = optax.apply_updates(state["params"], updates)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
  return keep(params, state["params"]), keep(opt, state["opt"]), gnorm, 1.0 - ok.astype(jnp.float32)


def due(done: int, every: int, total: int) -> bool:
  """Whether an every-`every`-steps action (eval, checkpoint) runs after step `done` of `total` (always at the end)."""
  return done % every == 0 or done == total
