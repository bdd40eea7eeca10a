"""Actor / critic losses for RL post-training (docs/rl.md): MIS-PO and its baselines.

Conventions shared by every function here:
  * Per-token arrays are float32 [B, T] over the *response* positions (B trajectories, T response slots);
    ``logp[b, t] = log pi_theta(a_t | s_t)`` of the sampled token.
  * ``mask`` [B, T] (bool, integer or float) is nonzero on valid response tokens and treated as 0/1;
    padding, prompt and environment (tool-output) tokens are 0. Values at masked positions never affect a
    loss, a metric or a gradient (they are replaced by 0 before any arithmetic), so padding may hold garbage.
  * Normaliser: token-level mean over the whole batch. ``normalizer="valid"`` (default) divides the summed
    per-token loss by max(#valid tokens, 1) -- every valid response token, kept or filtered. This is our
    reading of the report's expectation E_{tau ~ pi_vllm}[...] over all sampled tokens (a filtered token
    contributes zero but still counts). ``"kept"`` divides by max(#kept tokens, 1): the MIS-kept tokens for
    MIS-PO / GSPO; PPO and TIS filter nothing, so for them "kept" = "valid" (every actor objective accepts both,
    so rl.normalizer means the same for all of them). ``unbiased_kl`` / ``value_loss`` take "valid" or a number.
    A positive number (or scalar array) is used as the denominator as is, e.g. the valid-token count of the
    whole generation when one loss is split over gradient-accumulation micro-batches.
  * ``logp_old``, ``logp_rollout``, ``logp_ref`` and ``advantages`` are constants (stop_gradient inside).
  * Every function returns ``(loss, metrics)`` with ``metrics`` a dict of float32 scalars (except
    ``unbiased_kl`` and ``entropy_from_logits``, which return the scalar, optionally with the per-token array).
  * Inputs are validated on static shapes/dtypes before computing (so it also works under jit): a shape or dtype
    mismatch raises ValueError naming the arrays and their dtype[shape]. String / float options must be static.
    float64 inputs (NumPy's default) are accepted and computed in float32 (float64 when jax x64 is enabled).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from stepflash_jax.checks import is_number
from stepflash_jax.rl.checks import check_arrays, fail

sg = jax.lax.stop_gradient


def _bounds(fn: str, name: str, bounds) -> tuple[float, float]:
  try:
    lo, hi = (float(b) for b in bounds)
  except (TypeError, ValueError):
    raise ValueError(f"{fn}: {name} must be a pair (low, high) of numbers, got {bounds!r}") from None
  if not (0.0 < lo <= hi):
    raise ValueError(f"{fn}: {name} must satisfy 0 < low <= high, got {tuple(bounds)}")
  return lo, hi


def _positive(fn: str, name: str, v):
  """A static option > 0 (a clip range, the TIS cap; inf allowed), or a ValueError naming it. A traced value (the
  caller jits over it) is the caller's to check."""
  if isinstance(v, jax.core.Tracer):
    return v
  scalar = is_number(v) or (isinstance(v, jax.Array) and v.ndim == 0 and jnp.issubdtype(v.dtype, jnp.floating))
  if not (scalar and v > 0):
    raise ValueError(f"{fn}: {name} must be a number > 0, got {v!r}")
  return v


def _denominator(fn: str, normalizer, n_valid, n_kept=None):
  if isinstance(normalizer, str):
    if normalizer == "valid":
      return jnp.maximum(n_valid, 1.0)
    if normalizer == "kept" and n_kept is not None:
      return jnp.maximum(n_kept, 1.0)
    allowed = "'valid', 'kept'" if n_kept is not None else "'valid'"
    raise ValueError(f"{fn}: normalizer must be {allowed} or a positive number, got {normalizer!r}")
  if isinstance(normalizer, bool) or (is_number(normalizer) and not normalizer > 0):
    raise ValueError(f"{fn}: a numeric normalizer must be a number > 0, got {normalizer!r}")
  return jnp.asarray(normalizer, jnp.float32)


def _safe(valid, x):
  """x at valid positions, 0 elsewhere (kills garbage in padding before any arithmetic)."""
  return jnp.where(valid, x, 0.0)


def _frac(num, den):
  return num / jnp.maximum(den, 1.0)


# ----------------------------------------------------------------------------- MIS masks
RHO_TOKENS = ("all", "kept")  # the tokens rho runs over (rl.rho_tokens; the report's formula: all)


def _row_mean(x, sel, n):
  """Mean of x [B, T] over sel per row (0 for an empty row), summed as offsets from the row's first selected value:
  a row of equal values gives exactly that value (a plain float32 sum drifts by an ulp or more, which is enough to
  move a ratio sitting exactly on a bound across it)."""
  first = jnp.take_along_axis(x, jnp.argmax(sel, -1)[:, None], -1)[:, 0]
  mean = first + jnp.where(sel, x - first[:, None], 0.0).sum(-1) / jnp.maximum(n, 1.0)
  return jnp.where(n > 0, mean, 0.0)


def mis_mask(logp_old, logp_rollout, mask, token_bounds=(0.5, 2.0), traj_bounds=(0.996, 1.001), rho_tokens="all"):
  """The two importance-sampling filter masks of MIS-PO (docs/rl.md §2).

  x_t = pi_old / pi_vllm = exp(logp_old - logp_rollout); rho = exp(mean_t log x_t) over the trajectory's valid
  tokens (geometric mean of x_t over *all* valid response tokens; rho_tokens="kept": over those inside the token
  bounds only, the report's formula leaving it open); keep_t = mask_t * I(x_t) * I(rho) with
  I(x) = 1[low <= x <= high] (bounds inclusive). A trajectory without valid tokens is filtered. The bound tests
  are done in log space (log x_t against log(low)/log(high) rounded to float32), so a ratio given as exactly
  log(2) / log(0.5) in float32 sits exactly on the bound and is kept.

  Args: logp_old, logp_rollout float32 [B, T]; mask [B, T]. Returns (keep float32 [B, T], info dict):
    info: valid bool [B,T], token_ok bool [B,T] (valid and inside token bounds), traj_ok bool [B],
          nonempty bool [B], log_rho float32 [B] (0 for empty trajectories), n_valid float32 [B],
          log_x float32 [B, T] (logp_old - logp_rollout, 0 where masked).
  """
  fn = "mis_mask"
  logp_old, logp_rollout, mask = check_arrays(fn, {"logp_old": logp_old, "logp_rollout": logp_rollout, "mask": mask})
  t_lo, t_hi = _bounds(fn, "token_bounds", token_bounds)
  r_lo, r_hi = _bounds(fn, "traj_bounds", traj_bounds)
  if rho_tokens not in RHO_TOKENS:
    raise ValueError(f"{fn}: rho_tokens must be one of {RHO_TOKENS}, got {rho_tokens!r}")
  valid = mask != 0
  log_x = _safe(valid, sg(logp_old) - sg(logp_rollout))
  n_valid = valid.sum(-1).astype(jnp.float32)
  nonempty = n_valid > 0
  token_ok = valid & (log_x >= math.log(t_lo)) & (log_x <= math.log(t_hi))
  in_rho = valid if rho_tokens == "all" else token_ok
  n_rho = in_rho.sum(-1).astype(jnp.float32)
  log_rho = _row_mean(log_x, in_rho, n_rho)
  traj_ok = (n_rho > 0) & (log_rho >= math.log(r_lo)) & (log_rho <= math.log(r_hi))
  keep = (token_ok & traj_ok[:, None]).astype(jnp.float32)
  info = dict(
    valid=valid, token_ok=token_ok, traj_ok=traj_ok, nonempty=nonempty, log_rho=log_rho, n_valid=n_valid, log_x=log_x
  )
  return keep, info


def _mis_metrics(keep, info) -> dict:
  valid, nonempty = info["valid"], info["nonempty"]
  n_valid = valid.sum().astype(jnp.float32)
  n_traj = nonempty.sum().astype(jnp.float32)
  log_rho = info["log_rho"]
  any_traj = n_traj > 0
  rho = jnp.exp(log_rho)
  return {
    "token_keep_frac": _frac(info["token_ok"].sum(), n_valid),
    "traj_keep_frac": _frac(info["traj_ok"].sum(), n_traj),
    "kept_frac": _frac(keep.sum(), n_valid),
    "logp_abs_diff_mean": _frac(jnp.abs(info["log_x"]).sum(), n_valid),
    "rho_mean": jnp.where(any_traj, _frac(jnp.where(nonempty, rho, 0.0).sum(), n_traj), 1.0),
    "rho_min": jnp.where(any_traj, jnp.where(nonempty, rho, jnp.inf).min(), 1.0),
    "rho_max": jnp.where(any_traj, jnp.where(nonempty, rho, -jnp.inf).max(), 1.0),
    "n_valid_tokens": n_valid,
  }


# ----------------------------------------------------------------------------- actor losses
def mispo_loss(
  logp,
  logp_old,
  logp_rollout,
  advantages,
  mask,
  token_bounds=(0.5, 2.0),
  traj_bounds=(0.996, 1.001),
  normalizer="valid",
  rho_tokens="all",
):
  """MIS-PO actor loss (docs/rl.md §3):

      L = -sum_{b,t} keep_{b,t} * logp_{b,t} * sg(A_{b,t}) / denominator,
      keep = mask * I(x_t in token_bounds) * I(rho in traj_bounds)      (see ``mis_mask``)

  No importance weight and no clipping: kept tokens are treated as on-policy, filtered ones contribute zero.
  Default denominator max(#valid tokens, 1) counts filtered tokens too (our reading of the report's expectation
  over all sampled tokens; the report leaves it open); ``normalizer="kept"`` uses max(#kept, 1). ``rho_tokens``:
  the tokens rho averages over, "all" valid ones (default) or those the token filter "kept" (``mis_mask``).
  Gradient: dL/dlogp_{b,t} = -keep_{b,t} * A_{b,t} / denominator.

  Args: logp, logp_old, logp_rollout, advantages float32 [B, T]; mask [B, T].
  Returns (loss float32 scalar, metrics): token_keep_frac (valid tokens inside the token bounds / valid),
    traj_keep_frac (trajectories with >= 1 valid token passing the rho bounds / trajectories with >= 1 valid
    token), kept_frac (kept / valid), logp_abs_diff_mean (mean |logp_old - logp_rollout| over valid tokens),
    rho_mean/rho_min/rho_max (over trajectories with >= 1 valid token; 1.0 if there are none), n_valid_tokens,
    denominator.
  """
  fn = "mispo_loss"
  logp, logp_old, logp_rollout, advantages, mask = check_arrays(
    fn, {"logp": logp, "logp_old": logp_old, "logp_rollout": logp_rollout, "advantages": advantages, "mask": mask}
  )
  keep, info = mis_mask(logp_old, logp_rollout, mask, token_bounds, traj_bounds, rho_tokens)
  valid = info["valid"]
  denom = _denominator(fn, normalizer, valid.sum().astype(jnp.float32), keep.sum())
  per_token = keep * _safe(valid, logp) * sg(_safe(valid, advantages))
  loss = -per_token.sum() / denom
  metrics = _mis_metrics(keep, info)
  metrics["denominator"] = denom
  return loss, metrics


def ppo_loss(logp, logp_old, advantages, mask, clip_eps=0.2, normalizer="valid"):
  """PPO clipped surrogate (baseline in docs/rl.md §4), ratio r_t = pi_theta / pi_old:

      L = -sum_t mask_t * min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t) / denominator

  Denominator as in ``mispo_loss`` (default max(#valid tokens, 1); nothing is filtered, so "kept" = "valid").
  Args: logp, logp_old, advantages float32 [B, T]; mask [B, T].
  Returns (loss, metrics): clip_frac (valid tokens whose clipped branch is active, i.e. A > 0 and
    r > 1 + eps or A < 0 and r < 1 - eps, / valid), ratio_mean, ratio_max, approx_kl (mean of r - 1 - log r, the
    k3 estimate of KL(pi_old || pi_theta)), n_valid_tokens, denominator.
  """
  fn = "ppo_loss"
  logp, logp_old, advantages, mask = check_arrays(
    fn, {"logp": logp, "logp_old": logp_old, "advantages": advantages, "mask": mask}
  )
  clip_eps = _positive(fn, "clip_eps", clip_eps)
  valid = mask != 0
  n_valid = valid.sum().astype(jnp.float32)
  denom = _denominator(fn, normalizer, n_valid, n_kept=n_valid)
  adv = sg(_safe(valid, advantages))
  log_r = _safe(valid, logp - sg(logp_old))
  ratio = jnp.exp(log_r)
  surr = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
  loss = -jnp.where(valid, surr, 0.0).sum() / denom
  clipped = valid & (((adv > 0) & (ratio > 1.0 + clip_eps)) | ((adv < 0) & (ratio < 1.0 - clip_eps)))
  r = sg(ratio)
  metrics = {
    "clip_frac": _frac(clipped.sum(), n_valid),
    "ratio_mean": _frac(jnp.where(valid, r, 0.0).sum(), n_valid),
    "ratio_max": jnp.where(valid, r, 0.0).max(),
    "approx_kl": _frac(jnp.where(valid, r - 1.0 - sg(log_r), 0.0).sum(), n_valid),
    "n_valid_tokens": n_valid,
    "denominator": denom,
  }
  return loss, metrics


def gspo_loss(
  logp,
  logp_old,
  logp_rollout,
  advantages,
  mask,
  clip_eps=1e-4,
  token_bounds=(0.5, 2.0),
  traj_bounds=(0.996, 1.001),
  normalizer="valid",
  rho_tokens="all",
):
  """GSPO extended to actor-critic (baseline in docs/rl.md §4), with the two MIS masks of ``mispo_loss``.

  Sequence ratio s_b = (prod_t pi_theta / pi_old)^(1/n_b) = exp(mean over the n_b valid tokens of
  logp - logp_old). Per-token advantages A_t need a per-token gradient, so we use GSPO-token's form
  s_{b,t} = sg(s_b) * pi_theta(a_t) / sg(pi_theta(a_t)): numerically s_b, with d s_{b,t} / d logp_{b,t} = s_b
  (plain s_b would give every token the gradient of the sequence-mean advantage instead of its own A_t).

      L = -sum_{b,t} keep_{b,t} * min(s_{b,t} A_t, clip(s_{b,t}, 1 - eps, 1 + eps) A_t) / denominator

  keep is the MIS mask (``mis_mask``) from logp_old vs logp_rollout; denominator as in ``mispo_loss``
  (default max(#valid tokens, 1), filtered tokens counted; "kept" available). Gradient w.r.t. logp_{b,t}:
  -keep * s_b * A_t / denominator unless the clip is active (A > 0 and s > 1 + eps, or A < 0 and s < 1 - eps),
  where it is 0.
  Returns (loss, metrics): the MIS metrics of ``mispo_loss`` plus clip_frac (kept tokens with the clip active /
    kept tokens), seq_ratio_mean/min/max (s over trajectories with >= 1 valid token; 1.0 if none), denominator.
  """
  fn = "gspo_loss"
  logp, logp_old, logp_rollout, advantages, mask = check_arrays(
    fn, {"logp": logp, "logp_old": logp_old, "logp_rollout": logp_rollout, "advantages": advantages, "mask": mask}
  )
  clip_eps = _positive(fn, "clip_eps", clip_eps)
  keep, info = mis_mask(logp_old, logp_rollout, mask, token_bounds, traj_bounds, rho_tokens)
  valid, nonempty, n_seq = info["valid"], info["nonempty"], info["n_valid"]
  denom = _denominator(fn, normalizer, valid.sum().astype(jnp.float32), keep.sum())
  adv = sg(_safe(valid, advantages))
  logp = _safe(valid, logp)
  log_s = _safe(valid, logp - sg(logp_old)).sum(-1) / jnp.maximum(n_seq, 1.0)  # [B]
  s_tok = jnp.exp(sg(log_s)[:, None] + logp - sg(logp))  # [B, T], value s_b
  surr = jnp.minimum(s_tok * adv, jnp.clip(s_tok, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
  loss = -(keep * surr).sum() / denom
  s = sg(jnp.exp(log_s))
  clipped = keep * (((adv > 0) & (s[:, None] > 1.0 + clip_eps)) | ((adv < 0) & (s[:, None] < 1.0 - clip_eps)))
  n_traj = nonempty.sum().astype(jnp.float32)
  any_traj = n_traj > 0
  metrics = _mis_metrics(keep, info)
  metrics.update(
    {
      "clip_frac": _frac(clipped.sum(), keep.sum()),
      "seq_ratio_mean": jnp.where(any_traj, _frac(jnp.where(nonempty, s, 0.0).sum(), n_traj), 1.0),
      "seq_ratio_min": jnp.where(any_traj, jnp.where(nonempty, s, jnp.inf).min(), 1.0),
      "seq_ratio_max": jnp.where(any_traj, jnp.where(nonempty, s, -jnp.inf).max(), 1.0),
      "denominator": denom,
    }
  )
  return loss, metrics


def tis_loss(logp, logp_old, logp_rollout, advantages, mask, cap=2.0, normalizer="valid"):
  """Truncated importance sampling policy gradient (comparison baseline):

      L = -sum_t mask_t * min(x_t, C) * logp_t * sg(A_t) / denominator,   x_t = sg(exp(logp_old - logp_rollout))

  i.e. REINFORCE on samples from pi_vllm, re-weighted towards pi_old with the weight truncated at C = cap;
  no PPO ratio, no clipping, nothing filtered. Denominator max(#valid tokens, 1) (or a number; "kept" = "valid").
  Gradient: dL/dlogp_t = -mask_t * min(x_t, C) * A_t / denominator.
  Returns (loss, metrics): trunc_frac (valid tokens with x_t > C / valid), token_ratio_mean (mean x_t),
    logp_abs_diff_mean, n_valid_tokens, denominator.
  """
  fn = "tis_loss"
  logp, logp_old, logp_rollout, advantages, mask = check_arrays(
    fn, {"logp": logp, "logp_old": logp_old, "logp_rollout": logp_rollout, "advantages": advantages, "mask": mask}
  )
  cap = _positive(fn, "cap", cap)
  valid = mask != 0
  n_valid = valid.sum().astype(jnp.float32)
  denom = _denominator(fn, normalizer, n_valid, n_kept=n_valid)
  log_x = _safe(valid, sg(logp_old) - sg(logp_rollout))
  x = jnp.exp(log_x)
  w = jnp.where(valid, jnp.minimum(x, cap), 0.0)
  loss = -(w * _safe(valid, logp) * sg(_safe(valid, advantages))).sum() / denom
  metrics = {
    "trunc_frac": _frac((valid & (x > cap)).sum(), n_valid),
    "token_ratio_mean": _frac(jnp.where(valid, x, 0.0).sum(), n_valid),
    "logp_abs_diff_mean": _frac(jnp.abs(log_x).sum(), n_valid),
    "n_valid_tokens": n_valid,
    "denominator": denom,
  }
  return loss, metrics


# ----------------------------------------------------------------------------- regularisers, critic, entropy
def unbiased_kl(logp, logp_old, logp_ref, mask, normalizer="valid", per_token=False):
  """Unbiased KL estimator of DeepSeek-V3.2 (docs/rl.md §5; coefficient 0.001 in Step's final stage):

      KL_t = (pi_theta / pi_old) * (pi_ref / pi_theta - log(pi_ref / pi_theta) - 1)

  with the ratio pi_theta / pi_old NOT detached (only logp_old and logp_ref are constants). For tokens sampled
  from pi_old, E[KL_t] = KL(pi_theta || pi_ref) and E[grad KL_t] = grad KL(pi_theta || pi_ref) for any theta.
  Averaged like the losses: sum_t mask_t KL_t / denominator (default max(#valid tokens, 1)).
  Args: logp, logp_old, logp_ref float32 [B, T]; mask [B, T].
  Returns the float32 scalar, or (scalar, per-token KL [B, T] with 0 at masked positions) if per_token.
  """
  fn = "unbiased_kl"
  logp, logp_old, logp_ref, mask = check_arrays(
    fn, {"logp": logp, "logp_old": logp_old, "logp_ref": logp_ref, "mask": mask}
  )
  valid = mask != 0
  denom = _denominator(fn, normalizer, valid.sum().astype(jnp.float32))
  ratio = jnp.exp(_safe(valid, logp - sg(logp_old)))
  d = _safe(valid, sg(logp_ref) - logp)  # log(pi_ref / pi_theta)
  kl_tok = jnp.where(valid, ratio * (jnp.exp(d) - d - 1.0), 0.0)
  kl = kl_tok.sum() / denom
  return (kl, kl_tok) if per_token else kl


def value_loss(values, returns, mask, old_values=None, clip=None, normalizer="valid"):
  """Critic loss: 0.5 * (V_t - sg(R_t))^2 averaged over valid tokens (denominator max(#valid, 1) or a number).

  With ``clip`` (requires ``old_values``), PPO-style value clipping:
  V_clip = old + clip(V - old, -clip, clip), loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2).
  Args: values, returns (, old_values) float32 [B, T] at response positions (for GAE's [B, T+1] values pass
    values[:, :T]); mask [B, T].
  Returns (loss, metrics): value_mean, return_mean, value_abs_err, value_clip_frac (valid tokens with
    |V - old| > clip whose clipped term is the larger one / valid; 0 without clipping), n_valid_tokens,
    denominator.
  """
  fn = "value_loss"
  arrays = {"values": values, "returns": returns, "mask": mask}
  if old_values is not None:
    arrays["old_values"] = old_values
  checked = check_arrays(fn, arrays)
  values, returns, mask = checked[:3]
  if clip is not None:
    if old_values is None:
      raise ValueError(f"{fn}: clip={clip!r} needs old_values")
    clip = _positive(fn, "clip", clip)
  valid = mask != 0
  n_valid = valid.sum().astype(jnp.float32)
  denom = _denominator(fn, normalizer, n_valid)
  v, ret = _safe(valid, values), sg(_safe(valid, returns))
  err = jnp.square(v - ret)
  clip_frac = jnp.float32(0.0)
  if clip is not None:
    old = sg(_safe(valid, checked[3]))
    err_c = jnp.square(old + jnp.clip(v - old, -clip, clip) - ret)
    clip_frac = _frac((valid & (jnp.abs(v - old) > clip) & (err_c > err)).sum(), n_valid)
    err = jnp.maximum(err, err_c)
  loss = 0.5 * jnp.where(valid, err, 0.0).sum() / denom
  metrics = {
    "value_mean": _frac(sg(v).sum(), n_valid),
    "return_mean": _frac(ret.sum(), n_valid),
    "value_abs_err": _frac(jnp.abs(sg(v) - ret).sum(), n_valid),
    "value_clip_frac": clip_frac,
    "n_valid_tokens": n_valid,
    "denominator": denom,
  }
  return loss, metrics


def entropy_from_logits(logits, mask, per_token=False):
  """Mean token entropy H_t = -sum_v p_v log p_v, p = softmax(logits_t), over valid tokens (computed in fp32;
  -inf logits allowed, they contribute 0).
  Args: logits [B, T, V] any float dtype; mask [B, T].
  Returns the float32 scalar mean over valid tokens, or (scalar, per-token entropy [B, T], 0 where masked).
  """
  fn = "entropy_from_logits"
  logits = jnp.asarray(logits)
  if logits.ndim != 3 or not jnp.issubdtype(logits.dtype, jnp.floating):
    fail(fn, "logits must be a floating [B, T, V] array", {"logits": logits, "mask": mask})
  (mask,) = check_arrays(
    fn, {"mask": mask}, shape=logits.shape[:2], expect="[B, T] (logits [B, T, V])", context={"logits": logits}
  )
  valid = mask != 0
  z = jnp.where(valid[..., None], logits.astype(jnp.float32), 0.0)
  logp = jax.nn.log_softmax(z, axis=-1)
  p = jnp.exp(logp)
  ent = -jnp.where(p > 0, p * jnp.where(p > 0, logp, 0.0), 0.0).sum(-1)
  ent = jnp.where(valid, ent, 0.0)
  mean = ent.sum() / jnp.maximum(valid.sum(), 1).astype(jnp.float32)
  return (mean, ent) if per_token else mean
