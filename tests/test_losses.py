"""stepflash_jax.rl.losses against independent float64 NumPy references (values and gradients w.r.t. logp)."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stepflash_jax.rl import losses

F32 = np.float32
LOG2 = F32(math.log(2.0))


# ----------------------------------------------------------------------------- helpers / references
def _mask(lengths, T):
  return (np.arange(T)[None, :] < np.asarray(lengths)[:, None]).astype(F32)


def _garbage(rng, x, mask, scale=80.0):
  """Replace masked entries with large NaN-free garbage (exp of it overflows float32)."""
  return np.where(mask > 0, x, rng.uniform(-scale, scale, x.shape)).astype(F32)


def _log_x_with_rho(rng, lengths, T, rhos, std=0.3):
  """Per-token log x with geometric mean exactly `rho` per trajectory (up to float32 rounding)."""
  out = np.zeros((len(lengths), T))
  for b, (n, rho) in enumerate(zip(lengths, rhos)):
    if n:
      z = rng.normal(0, std, n)
      out[b, :n] = z - z.mean() + math.log(rho)
  return out


def np_mis_keep(logp_old, logp_rollout, mask, tb=(0.5, 2.0), rb=(0.996, 1.001)):
  lo, lr, m = (np.asarray(a, np.float64) for a in (logp_old, logp_rollout, mask))
  keep = np.zeros_like(m)
  traj_ok = np.zeros(m.shape[0], bool)
  rhos = []
  for b in range(m.shape[0]):
    idx = np.nonzero(m[b])[0]
    if len(idx) == 0:
      continue
    x = np.exp(lo[b, idx] - lr[b, idx])
    rho = np.prod(x) ** (1.0 / len(idx))
    rhos.append(rho)
    traj_ok[b] = rb[0] <= rho <= rb[1]
    for t, xt in zip(idx, x):
      keep[b, t] = float(tb[0] <= xt <= tb[1] and traj_ok[b])
  return keep, traj_ok, np.array(rhos)


def np_mispo(logp, logp_old, logp_rollout, adv, mask, normalizer="valid", **kw):
  keep, traj_ok, rhos = np_mis_keep(logp_old, logp_rollout, mask, **kw)
  n = max(mask.sum(), 1) if normalizer == "valid" else max(keep.sum(), 1)
  lp, a = np.where(mask > 0, logp, 0).astype(np.float64), np.where(mask > 0, adv, 0).astype(np.float64)
  loss = -(keep * lp * a).sum() / n
  grad = -keep * a / n
  return loss, grad, keep, traj_ok, rhos


def _grad(fn, logp, *args, **kw):
  f = jax.jit(jax.value_and_grad(lambda lp, *a: fn(lp, *a, **kw), has_aux=True))
  (loss, metrics), g = f(jnp.asarray(logp), *args)
  return float(loss), np.asarray(g), {k: float(v) for k, v in metrics.items()}


@pytest.fixture
def batch():
  """B=6 trajectories with rho 1.0, 0.998, 1.002, 0.995, 0.9995 and an empty row; garbage in padding."""
  rng = np.random.RandomState(0)
  B, T = 6, 9
  lengths = [9, 7, 5, 8, 3, 0]
  rhos = [1.0, 0.998, 1.002, 0.995, 0.9995, 1.0]
  mask = _mask(lengths, T)
  logp_rollout = -rng.uniform(0.1, 3.0, (B, T))
  logp_old = logp_rollout + _log_x_with_rho(rng, lengths, T, rhos, std=0.5)
  logp = logp_old + rng.normal(0, 0.05, (B, T))
  adv = rng.normal(0, 1, (B, T))
  arrs = [_garbage(rng, x, mask) for x in (logp, logp_old, logp_rollout, adv)]
  return (*arrs, mask)


# ----------------------------------------------------------------------------- MIS-PO
def test_mispo_matches_numpy(batch):
  logp, logp_old, logp_rollout, adv, mask = batch
  loss, g, m = _grad(losses.mispo_loss, logp, logp_old, logp_rollout, adv, mask)
  ref_loss, ref_g, keep, traj_ok, rhos = np_mispo(logp, logp_old, logp_rollout, adv, mask)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(g, ref_g, rtol=1e-5, atol=1e-8)
  # asymmetric trajectory bounds: rho 1.0, 0.998, 0.9995 kept; 1.002, 0.995 and the empty row filtered
  np.testing.assert_array_equal(traj_ok, [True, True, False, False, True, False])
  valid = mask > 0
  tok_ok = valid & (np.abs(logp_old - logp_rollout) <= math.log(2.0))
  assert 0 < tok_ok.sum() < valid.sum()  # the fixture exercises the token mask too
  assert m["token_keep_frac"] == pytest.approx(tok_ok.sum() / valid.sum(), rel=1e-6)
  assert m["traj_keep_frac"] == pytest.approx(3 / 5, rel=1e-6)
  assert m["kept_frac"] == pytest.approx(keep.sum() / valid.sum(), rel=1e-6)
  assert m["logp_abs_diff_mean"] == pytest.approx(np.abs(logp_old - logp_rollout)[valid].mean(), rel=1e-5)
  assert m["rho_mean"] == pytest.approx(rhos.mean(), rel=1e-6)
  assert m["rho_min"] == pytest.approx(rhos.min(), rel=1e-6)
  assert m["rho_max"] == pytest.approx(rhos.max(), rel=1e-6)
  assert m["n_valid_tokens"] == valid.sum() == m["denominator"]
  # gradient never flows into advantages / old / rollout log-probs
  ga = jax.grad(lambda *a: losses.mispo_loss(*a)[0], argnums=(1, 2, 3))(*map(jnp.asarray, batch))
  assert all(float(jnp.abs(x).max()) == 0.0 for x in ga)


def test_mispo_padding_never_matters(batch):
  logp, logp_old, logp_rollout, adv, mask = batch
  rng = np.random.RandomState(1)
  other = [_garbage(rng, x, mask, scale=1e4) for x in (logp, logp_old, logp_rollout, adv)]
  other[1] = np.where(mask > 0, logp_old, np.nan).astype(F32)  # even NaN in padding is harmless
  l1, g1, m1 = _grad(losses.mispo_loss, logp, logp_old, logp_rollout, adv, mask)
  l2, g2, m2 = _grad(losses.mispo_loss, *other, mask)
  assert l1 == l2 and m1 == m2
  np.testing.assert_array_equal(g1, g2)
  assert np.all(g1[mask == 0] == 0)


def test_token_bounds_inclusive():
  # log x exactly at log(0.5) / log(2) (float32) is kept, one float32 ulp outside is filtered.
  up, down = np.nextafter(LOG2, F32(np.inf)), np.nextafter(-LOG2, F32(-np.inf))
  log_x = np.array([[-LOG2, LOG2, up, down, 0.0, 0.0]], F32)
  mask = np.ones_like(log_x)
  logp_rollout = np.zeros_like(log_x)
  logp_old = log_x  # logp_old - logp_rollout is exactly log_x
  adv = np.ones_like(log_x)
  logp = np.full_like(log_x, -1.0)
  _, g, m = _grad(losses.mispo_loss, logp, logp_old, logp_rollout, adv, mask)
  np.testing.assert_array_equal(g[0] != 0, [True, True, False, False, True, True])
  assert m["token_keep_frac"] == pytest.approx(4 / 6)
  # custom bounds behave the same way
  _, g, _ = _grad(losses.mispo_loss, logp, logp_old, logp_rollout, adv, mask, token_bounds=(1.0, 2.0))
  np.testing.assert_array_equal(g[0] != 0, [False, True, False, False, True, True])


@pytest.mark.parametrize("bound", [0.996, 1.001])
def test_trajectory_exactly_on_a_bound_is_kept(bound):
  """Every token at log x = float32(log bound): rho sits on the bound for any length and the row is kept (a plain
  float32 sum of 18 or more such values drifts past the bound); one ulp further out on every token filters it."""
  lengths = np.array([1, 2, 17, 18, 21, 64, 255, 256])
  mask = _mask(lengths, 256)
  edge = F32(math.log(bound))
  out = np.nextafter(edge, F32(np.inf) if bound > 1 else F32(-np.inf))
  for log_x, kept in ((edge, True), (out, False)):
    logp_old = np.full(mask.shape, log_x, F32)  # logp_old - logp_rollout = log_x exactly
    keep, info = losses.mis_mask(logp_old, np.zeros_like(mask), mask, traj_bounds=(0.996, 1.001))
    np.testing.assert_array_equal(np.asarray(info["traj_ok"]), [kept] * len(lengths))
    np.testing.assert_array_equal(np.asarray(keep), mask if kept else 0 * mask)


def test_rho_tokens_switch():
  """rho over every valid token (the report's formula) or over the tokens inside the token bounds only."""
  log_x = np.zeros((2, 8), F32)
  log_x[0, 3] = math.log(10.0)  # one token far outside [0.5, 2]
  log_x[1, :5] = math.log(1.0005)
  mask = _mask([8, 5], 8)
  zeros = np.zeros_like(log_x)
  keep, info = losses.mis_mask(log_x, zeros, mask)
  np.testing.assert_allclose(np.exp(np.asarray(info["log_rho"])), [10 ** (1 / 8), 1.0005], rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(info["traj_ok"]), [False, True])  # 10^(1/8) = 1.33 > 1.001
  keep, info = losses.mis_mask(log_x, zeros, mask, rho_tokens="kept")
  np.testing.assert_allclose(np.exp(np.asarray(info["log_rho"])), [1.0, 1.0005], rtol=1e-6)
  want = mask.copy()
  want[0, 3] = 0.0  # the far-off token itself is still filtered by the token bounds
  np.testing.assert_array_equal(np.asarray(keep), want)
  adv, logp = np.ones_like(log_x), np.full_like(log_x, -1.0)
  loss, _ = losses.mispo_loss(logp, log_x, zeros, adv, mask, rho_tokens="kept")
  assert float(loss) == pytest.approx(want.sum() / mask.sum())
  with pytest.raises(ValueError, match="rho_tokens"):
    losses.mis_mask(log_x, zeros, mask, rho_tokens="some")


def test_everything_filtered_is_zero_and_finite():
  rng = np.random.RandomState(2)
  B, T = 3, 4
  mask = _mask([4, 2, 3], T)
  logp_rollout = -rng.uniform(0.1, 2, (B, T)).astype(F32)
  logp_old = (logp_rollout + math.log(1.01)).astype(F32)  # rho = 1.01 > 1.001 for every trajectory
  logp, adv = -rng.uniform(0.1, 2, (B, T)).astype(F32), rng.normal(size=(B, T)).astype(F32)
  for mk in (mask, np.zeros_like(mask)):  # all filtered; no valid token at all
    loss, g, m = _grad(losses.mispo_loss, logp, logp_old, logp_rollout, adv, mk)
    assert loss == 0.0 and np.all(g == 0) and np.all(np.isfinite(g))
    assert all(np.isfinite(v) for v in m.values())
    assert m["kept_frac"] == 0.0 and m["traj_keep_frac"] == 0.0


def test_normalizer_switch(batch):
  logp, logp_old, logp_rollout, adv, mask = batch
  l_kept, g_kept, m = _grad(losses.mispo_loss, logp, logp_old, logp_rollout, adv, mask, normalizer="kept")
  ref_loss, ref_g, keep, _, _ = np_mispo(logp, logp_old, logp_rollout, adv, mask, normalizer="kept")
  np.testing.assert_allclose(l_kept, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(g_kept, ref_g, rtol=1e-5, atol=1e-8)
  assert m["denominator"] == keep.sum() < mask.sum()
  l_num, _, _ = _grad(losses.mispo_loss, logp, logp_old, logp_rollout, adv, mask, normalizer=100.0)
  np.testing.assert_allclose(l_num, ref_loss * keep.sum() / 100.0, rtol=1e-5)
  with pytest.raises(ValueError, match="normalizer"):
    losses.mispo_loss(logp, logp_old, logp_rollout, adv, mask, normalizer="tokens")
  with pytest.raises(ValueError, match="normalizer must be a number > 0, got True"):
    losses.mispo_loss(logp, logp_old, logp_rollout, adv, mask, normalizer=True)
  with pytest.raises(ValueError, match="traj_bounds"):
    losses.mispo_loss(logp, logp_old, logp_rollout, adv, mask, traj_bounds=(1.001, 0.996))
  with pytest.raises(ValueError, match=r"token_bounds must be a pair \(low, high\) of numbers, got \(0.5, 1, 2\)"):
    losses.mispo_loss(logp, logp_old, logp_rollout, adv, mask, token_bounds=(0.5, 1, 2))


def test_mispo_under_jit(batch):
  f = jax.jit(functools.partial(losses.mispo_loss, normalizer="kept", traj_bounds=(0.99, 1.01)))
  l1, m1 = f(*batch)
  l2, m2 = losses.mispo_loss(*batch, normalizer="kept", traj_bounds=(0.99, 1.01))
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  assert m1["traj_keep_frac"] == 1.0  # all 5 non-empty rows inside the wider bounds


# ----------------------------------------------------------------------------- PPO / GSPO / TIS
def test_ppo_matches_numpy(batch):
  logp, logp_old, _, adv, mask = batch
  rng = np.random.RandomState(3)
  logp = np.where(mask > 0, logp_old + rng.normal(0, 0.3, logp.shape), logp).astype(F32)
  loss, g, m = _grad(losses.ppo_loss, logp, logp_old, adv, mask, clip_eps=0.2)
  v = mask > 0
  r = np.exp(np.where(v, logp.astype(np.float64) - logp_old, 0))
  a = np.where(v, adv, 0).astype(np.float64)
  surr = np.minimum(r * a, np.clip(r, 0.8, 1.2) * a)
  n = v.sum()
  clipped = v & (((a > 0) & (r > 1.2)) | ((a < 0) & (r < 0.8)))
  assert 0 < clipped.sum() < n
  np.testing.assert_allclose(loss, -surr[v].sum() / n, rtol=1e-5)
  np.testing.assert_allclose(g, np.where(v & ~clipped, -r * a / n, 0), rtol=1e-5, atol=1e-8)
  assert m["clip_frac"] == pytest.approx(clipped.sum() / n)
  assert m["ratio_mean"] == pytest.approx(r[v].mean(), rel=1e-5)
  assert m["approx_kl"] == pytest.approx((r - 1 - np.log(r))[v].mean(), rel=1e-4)


def test_gspo_matches_numpy():
  rng = np.random.RandomState(4)
  B, T = 7, 6
  lengths = [6, 6, 4, 5, 6, 3, 0]
  mask = _mask(lengths, T)
  v = mask > 0
  log_s = [0.0, 5e-5, -5e-5, 3e-4, -3e-4, 2e-4, 0.0]  # eps = 1e-4: rows 3, 4, 5 have s outside [1-eps, 1+eps]
  rhos = [1.0, 0.999, 1.0005, 1.0, 1.002, 1.0, 1.0]  # row 4 filtered by the trajectory mask
  logp_rollout = -rng.uniform(0.1, 3.0, (B, T))
  log_x = _log_x_with_rho(rng, lengths, T, rhos, std=0.2)
  rest = log_x[1, 2:]  # row 1: one token above and one below the token bounds,
  log_x[1] = [0.9, -0.9, *(rest - rest.mean() + 6 * math.log(0.999) / 4)]  # rho still 0.999
  logp_old = logp_rollout + log_x
  logp = logp_old + _log_x_with_rho(rng, lengths, T, np.exp(log_s), std=0.01)
  adv = rng.normal(0, 1, (B, T))
  logp, logp_old, logp_rollout, adv = (_garbage(rng, x, mask) for x in (logp, logp_old, logp_rollout, adv))
  loss, g, m = _grad(losses.gspo_loss, logp, logp_old, logp_rollout, adv, mask, clip_eps=1e-4)

  keep, _, _ = np_mis_keep(logp_old, logp_rollout, mask)
  assert keep[1, 0] == keep[1, 1] == 0 and keep[1].sum() > 0 and keep[4].sum() == 0
  ref_loss, ref_g, clipped = 0.0, np.zeros((B, T)), []
  for b in range(B):
    idx = np.nonzero(v[b])[0]
    if len(idx) == 0:
      continue
    s = np.exp(np.mean(logp[b, idx].astype(np.float64) - logp_old[b, idx]))
    for t in idx:
      a = float(adv[b, t])
      ref_loss -= keep[b, t] * min(s * a, np.clip(s, 1 - 1e-4, 1 + 1e-4) * a)
      is_clipped = (a > 0 and s > 1 + 1e-4) or (a < 0 and s < 1 - 1e-4)
      ref_g[b, t] = 0.0 if is_clipped else -keep[b, t] * s * a
      if keep[b, t]:
        clipped.append(is_clipped)
  n = v.sum()
  assert 0 < sum(clipped) < len(clipped)
  np.testing.assert_allclose(loss, ref_loss / n, rtol=1e-5)
  np.testing.assert_allclose(g, ref_g / n, rtol=1e-5, atol=1e-8)
  assert m["clip_frac"] == pytest.approx(np.mean(clipped))
  assert m["seq_ratio_max"] == pytest.approx(math.exp(3e-4), rel=1e-6)
  assert m["seq_ratio_min"] == pytest.approx(math.exp(-3e-4), rel=1e-6)
  assert m["kept_frac"] == pytest.approx(keep.sum() / n)


def test_tis_matches_numpy(batch):
  logp, logp_old, logp_rollout, adv, mask = batch
  loss, g, m = _grad(losses.tis_loss, logp, logp_old, logp_rollout, adv, mask, cap=1.5)
  v = mask > 0
  x = np.exp(np.where(v, logp_old.astype(np.float64) - logp_rollout, 0))
  w = np.where(v, np.minimum(x, 1.5), 0)
  a, lp = np.where(v, adv, 0), np.where(v, logp, 0)
  n = v.sum()
  assert 0 < (v & (x > 1.5)).sum()
  np.testing.assert_allclose(loss, -(w * lp * a).sum() / n, rtol=1e-5)
  np.testing.assert_allclose(g, -w * a / n, rtol=1e-5, atol=1e-8)
  assert m["trunc_frac"] == pytest.approx((v & (x > 1.5)).sum() / n)


def test_kept_normalizer_for_every_objective(batch):
  """normalizer="kept" is accepted by every actor loss; PPO and TIS filter nothing, so it equals "valid"."""
  logp, logp_old, logp_rollout, adv, mask = batch
  for fn, args in ((losses.ppo_loss, (logp_old, adv, mask)), (losses.tis_loss, (logp_old, logp_rollout, adv, mask))):
    valid, kept = (fn(logp, *args, normalizer=n) for n in ("valid", "kept"))
    assert float(kept[1]["denominator"]) == float(valid[1]["denominator"]) == mask.sum()
    np.testing.assert_allclose(float(kept[0]), float(valid[0]), rtol=1e-6)


# ----------------------------------------------------------------------------- unbiased KL
def test_unbiased_kl_values(batch):
  logp, logp_old, logp_ref, _, mask = batch
  kl, tok = losses.unbiased_kl(logp, logp_old, logp_ref, mask, per_token=True)
  v = mask > 0
  lp, lo, lr = (np.where(v, x, 0).astype(np.float64) for x in (logp, logp_old, logp_ref))
  ref_tok = np.where(v, np.exp(lp - lo) * (np.exp(lr - lp) - (lr - lp) - 1), 0)
  np.testing.assert_allclose(tok, ref_tok, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(kl, ref_tok.sum() / v.sum(), rtol=1e-5)
  assert float(losses.unbiased_kl(logp, logp_old, logp_ref, mask)) == pytest.approx(float(kl))


@pytest.mark.parametrize("same_policy", [True, False])
def test_unbiased_kl_gradient_is_exact_kl_gradient(same_policy):
  """On a categorical with V actions, weight each action's per-token KL by pi_old(a) (the exact expectation over
  tokens sampled from pi_old): value and gradient w.r.t. theta must equal KL(pi_theta || pi_ref) and its exact
  gradient p * (l - KL), l = log p - log q. Holds for theta == theta_old and (ratio not detached) theta != old."""
  rng = np.random.RandomState(5)
  V = 6
  theta_old = rng.normal(0, 1, V)
  theta = theta_old if same_policy else theta_old + rng.normal(0, 0.5, V)
  log_q = np.log(rng.dirichlet(np.ones(V)))
  logp_old = jax.nn.log_softmax(jnp.asarray(theta_old, F32))
  p_old = jnp.exp(logp_old)

  def expected_kl(th):
    logp = jax.nn.log_softmax(th)[None, :]  # one "trajectory" holding every action once
    _, tok = losses.unbiased_kl(
      logp, logp_old[None, :], jnp.asarray(log_q, F32)[None, :], jnp.ones((1, V), F32), per_token=True
    )
    return (p_old * tok[0]).sum()

  val, g = jax.value_and_grad(expected_kl)(jnp.asarray(theta, F32))
  p = np.exp(theta - theta.max())
  p /= p.sum()
  l = np.log(p) - log_q
  kl = (p * l).sum()
  np.testing.assert_allclose(val, kl, rtol=1e-5)
  np.testing.assert_allclose(g, p * (l - kl), rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- critic / entropy
@pytest.mark.parametrize("clip", [None, 0.1])
def test_value_loss_matches_numpy(clip):
  rng = np.random.RandomState(6)
  B, T = 4, 5
  mask = _mask([5, 3, 1, 4], T)
  v = mask > 0
  values, returns, old = (_garbage(rng, rng.normal(size=(B, T)), mask) for _ in range(3))
  old_arg = old if clip else None
  (loss, m), g = jax.value_and_grad(
    lambda x: losses.value_loss(x, returns, mask, old_values=old_arg, clip=clip), has_aux=True
  )(values)
  vv, rr, oo = (np.where(v, x, 0).astype(np.float64) for x in (values, returns, old))
  err = (vv - rr) ** 2
  gref = vv - rr
  if clip:
    vc = oo + np.clip(vv - oo, -clip, clip)
    errc = (vc - rr) ** 2
    gref = np.where(errc > err, np.where(np.abs(vv - oo) < clip, vc - rr, 0), gref)
    active = v & (np.abs(vv - oo) > clip) & (errc > err)
    assert 0 < active.sum() < v.sum()
    assert float(m["value_clip_frac"]) == pytest.approx(active.sum() / v.sum())
    err = np.maximum(err, errc)
  np.testing.assert_allclose(loss, 0.5 * err[v].sum() / v.sum(), rtol=1e-5)
  np.testing.assert_allclose(g, np.where(v, gref, 0) / v.sum(), rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match="old_values"):
    losses.value_loss(values, returns, mask, clip=0.2)


def test_entropy_matches_numpy():
  rng = np.random.RandomState(7)
  B, T, V = 2, 3, 5
  logits = rng.normal(0, 2, (B, T, V)).astype(F32)
  logits[0, 0, 1] = -np.inf  # a banned token contributes 0
  mask = _mask([3, 2], T)
  logits[1, 2] = 1e30  # garbage at a masked position
  mean, tok = losses.entropy_from_logits(logits, mask, per_token=True)
  z = logits.astype(np.float64)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  ent = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0).sum(-1)
  ent = np.where(mask > 0, ent, 0)
  np.testing.assert_allclose(tok, ent, rtol=1e-5)
  np.testing.assert_allclose(mean, ent.sum() / mask.sum(), rtol=1e-5)
  g = jax.grad(lambda x: losses.entropy_from_logits(x, mask))(jnp.asarray(logits))
  assert np.all(np.isfinite(np.asarray(g)))
  bf = losses.entropy_from_logits(jnp.asarray(np.nan_to_num(logits, neginf=-1e4), jnp.bfloat16), mask)
  assert bf.dtype == jnp.float32 and abs(float(bf) - float(mean)) < 0.05


# ----------------------------------------------------------------------------- validation
def _bt(shape=(3, 5), dtype=F32):
  return np.zeros(shape, dtype)


SIGS = {  # function -> argument names in order (float32 arrays, then the mask)
  "mispo_loss": ["logp", "logp_old", "logp_rollout", "advantages", "mask"],
  "gspo_loss": ["logp", "logp_old", "logp_rollout", "advantages", "mask"],
  "tis_loss": ["logp", "logp_old", "logp_rollout", "advantages", "mask"],
  "ppo_loss": ["logp", "logp_old", "advantages", "mask"],
  "unbiased_kl": ["logp", "logp_old", "logp_ref", "mask"],
  "value_loss": ["values", "returns", "mask"],
}


@pytest.mark.parametrize("fn", sorted(SIGS))
@pytest.mark.parametrize("case", ["shape", "float16", "bfloat16", "mask_rank", "not_an_array"])
def test_bad_inputs_raise(fn, case):
  names = SIGS[fn]
  args = [_bt() for _ in names]
  if case == "shape":
    args[1], needle = _bt((3, 4)), rf"{names[1]} has shape \[3, 4\], must match {names[0]} \[3, 5\]"
  elif case == "float16":
    args[-2], needle = _bt(dtype=np.float16), rf"{names[-2]} is float16, expected float32"
  elif case == "bfloat16":
    args[0], needle = jnp.zeros((3, 5), jnp.bfloat16), rf"{names[0]} is bfloat16, expected float32"
  elif case == "mask_rank":
    args[-1], needle = _bt((3, 5, 1)), r"mask must have rank 2"
  else:
    args[1], needle = "0.5", rf"{names[1]} must be a numeric array, got str"
  with pytest.raises(ValueError, match=needle) as e:
    getattr(losses, fn)(*args)
  msg = str(e.value)
  assert msg.startswith(fn + ":") and all(f"{k} " in msg.split("Got:")[1] for k in names)


def test_bad_options_are_named():
  """clip_eps (PPO, GSPO), the TIS cap and the value clip: a number > 0 (inf allowed, numpy / jax scalars too, a
  traced value passes); anything else is a ValueError naming the option."""
  a = [_bt() for _ in range(5)]
  calls = {
    "ppo_loss: clip_eps": lambda v: losses.ppo_loss(*a[:4], clip_eps=v),
    "gspo_loss: clip_eps": lambda v: losses.gspo_loss(*a, clip_eps=v),
    "tis_loss: cap": lambda v: losses.tis_loss(*a, cap=v),
    "value_loss: clip": lambda v: losses.value_loss(a[0], a[1], a[4], old_values=a[2], clip=v),
  }
  for where, call in calls.items():
    for bad in ("0.2", -0.1, 0, True, float("nan"), (0.2,), None if "value" not in where else [0.2]):
      with pytest.raises(ValueError, match=rf"{where} must be a number > 0, got {re.escape(repr(bad))}"):
        call(bad)
    want = float(call(0.2)[0])
    assert float(call(np.float32(0.2))[0]) == float(call(jnp.float32(0.2))[0]) == want
    assert float(jax.jit(lambda v: call(v)[0])(0.2)) == pytest.approx(want, abs=1e-7)
    assert np.isfinite(float(call(float("inf"))[0]))


def test_bad_inputs_raise_under_jit():
  f = jax.jit(losses.mispo_loss)
  with pytest.raises(ValueError, match=r"mispo_loss: .*logp_rollout has shape \[2, 5\]"):
    f(_bt(), _bt(), _bt((2, 5)), _bt(), _bt())
  with pytest.raises(ValueError, match=r"mask must have rank 2 .*\[B, T\] \(logits"):
    losses.entropy_from_logits(np.zeros((3, 5, 7), F32), _bt((3,)))
  with pytest.raises(ValueError, match=r"mask must be bool, integer or float32/float64, is float16"):
    losses.mispo_loss(_bt(), _bt(), _bt(), _bt(), _bt(dtype=np.float16))


@pytest.mark.parametrize("fn", sorted(SIGS))
def test_float64_numpy_inputs_match_float32(fn):
  """NumPy's default float64 (arrays and mask) is accepted and gives the float32 result (x64 off: computed in f32)."""
  rng = np.random.default_rng(7)
  names = SIGS[fn]
  args = [rng.normal(-1.0, 0.05, (4, 6)) for _ in names[:-1]] + [_mask([6, 3, 0, 5], 6).astype(np.float64)]
  got = getattr(losses, fn)(*args)
  want = getattr(losses, fn)(*[a.astype(F32) for a in args])
  g, w = (x[0] if isinstance(x, tuple) else x for x in (got, want))
  assert g.dtype == jnp.float32
  np.testing.assert_allclose(float(g), float(w), rtol=1e-6, atol=1e-7)
