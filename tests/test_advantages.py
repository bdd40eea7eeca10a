"""stepflash_jax.rl.advantages against plain NumPy recursions / closed forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stepflash_jax.rl import advantages as adv_mod

F32 = np.float32


def _mask(lengths, T):
  return (np.arange(T)[None, :] < np.asarray(lengths)[:, None]).astype(F32)


def np_gae(rewards, values, mask, gamma, lam, bootstrap=None):
  """Backwards recursion over each row's valid positions (holes skipped), float64."""
  B, T = rewards.shape
  adv = np.zeros((B, T))
  for b in range(B):
    idx = np.nonzero(mask[b])[0]
    if len(idx) == 0:
      continue
    v_next = float(values[b, idx[-1] + 1]) if bootstrap is not None and bootstrap[b] else 0.0
    a_next = 0.0
    for t in idx[::-1]:
      delta = rewards[b, t] + gamma * v_next - values[b, t]
      a_next = delta + gamma * lam * a_next
      v_next = float(values[b, t])
      adv[b, t] = a_next
  return adv, np.where(mask > 0, adv + values[:, :T], 0)


def np_gae_closed_form(rewards, values, n, gamma, lam):
  """Contiguous response of length n, terminal: A_t = sum_l (gamma lam)^l delta_{t+l}."""
  v = np.append(values[:n], 0.0)
  delta = rewards[:n] + gamma * v[1:] - v[:-1]
  return np.array([sum((gamma * lam) ** l * delta[t + l] for l in range(n - t)) for t in range(n)])


@pytest.fixture
def data():
  rng = np.random.RandomState(0)
  B, T = 5, 8
  lengths = [8, 5, 3, 1, 0]
  mask = _mask(lengths, T)
  rewards = rng.normal(size=(B, T)).astype(F32)
  values = rng.normal(size=(B, T + 1)).astype(F32)
  return rewards, values, mask, lengths


def test_gae_matches_numpy_recursion_and_closed_form(data):
  rewards, values, mask, lengths = data
  gae = jax.jit(adv_mod.gae_advantages, static_argnames=())
  adv, ret = gae(rewards, values, mask, 0.9, 0.8)
  ref_adv, ref_ret = np_gae(rewards.astype(np.float64), values.astype(np.float64), mask, 0.9, 0.8)
  np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-6)
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(adv[b, :n], np_gae_closed_form(rewards[b], values[b], n, 0.9, 0.8), rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(adv)[mask == 0] == 0) and np.all(np.asarray(ret)[mask == 0] == 0)


def test_gae_padding_and_masked_rewards_never_matter(data):
  rewards, values, mask, lengths = data
  rng = np.random.RandomState(1)
  r2 = np.where(mask > 0, rewards, rng.uniform(-1e4, 1e4, rewards.shape)).astype(F32)
  v2 = values.copy()
  for b, n in enumerate(lengths):  # everything after V(s_n) is unused
    v2[b, n + 1 :] = rng.uniform(-1e4, 1e4, len(v2[b, n + 1 :]))
  for boot in (None, np.array([1, 0, 1, 1, 0], bool)):
    a1, r1 = adv_mod.gae_advantages(rewards, values, mask, 0.95, 0.9, bootstrap=boot)
    a2, r2_ = adv_mod.gae_advantages(r2, v2, mask, 0.95, 0.9, bootstrap=boot)
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(r1, r2_)


def test_gae_holes_in_mask(data):
  """Multi-turn masks (tool-output tokens masked inside the response) skip those steps without discounting."""
  rewards, values, _, _ = data
  mask = np.array([[1, 1, 0, 0, 1, 1, 0, 1], [0, 1, 1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 1, 0, 1, 0], [0] * 8, [1] * 8], F32)
  boot = np.array([True, True, False, True, True])
  adv, ret = adv_mod.gae_advantages(rewards, values, mask, 0.9, 0.7, bootstrap=boot)
  ref_adv, ref_ret = np_gae(rewards.astype(np.float64), values.astype(np.float64), mask, 0.9, 0.7, boot)
  np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-6)


def test_gamma_lambda_one_terminal_reward(data):
  _, values, mask, lengths = data
  R = np.array([1.0, -0.5, 2.0, 0.25, 3.0], F32)
  rewards = adv_mod.place_terminal_reward(R, mask)
  expect_r = np.zeros_like(mask)
  for b, n in enumerate(lengths):
    if n:
      expect_r[b, n - 1] = R[b]
  np.testing.assert_array_equal(rewards, expect_r)
  adv, ret = adv_mod.gae_advantages(rewards, values, mask)  # gamma = lam = 1 by default
  np.testing.assert_allclose(adv, np.where(mask > 0, R[:, None] - values[:, :-1], 0), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(ret, np.where(mask > 0, R[:, None], 0), rtol=1e-6, atol=1e-6)


def test_last_index_and_value_after_last(data):
  _, values, mask, lengths = data
  np.testing.assert_array_equal(adv_mod.last_valid_index(mask), [n - 1 for n in lengths])
  np.testing.assert_array_equal(adv_mod.value_after_last(values, mask), [values[b, n] for b, n in enumerate(lengths)])
  holes = np.array([[1, 0, 1, 0]], bool)
  assert int(adv_mod.last_valid_index(holes)[0]) == 2


def test_terminal_reward_modes():
  task = np.array([1.0, 0.0, 1.0, 0.5], F32)
  trunc = np.array([False, True, True, False])
  final_v = np.array([0.3, 0.7, -0.2, 0.9], F32)
  np.testing.assert_array_equal(
    adv_mod.terminal_rewards(task, trunc, final_v, "bootstrap"), np.array([1.0, 0.7, -0.2, 0.5], F32)
  )
  np.testing.assert_array_equal(adv_mod.terminal_rewards(task, trunc, mode="zero"), [1.0, 0.0, 0.0, 0.5])
  np.testing.assert_array_equal(adv_mod.terminal_rewards(task, trunc, mode="task"), task)
  g = jax.grad(lambda v: adv_mod.terminal_rewards(task, trunc, v).sum())(jnp.asarray(final_v))
  assert np.all(np.asarray(g) == 0)  # V(s_T) enters as a constant target
  with pytest.raises(ValueError, match="final_values"):
    adv_mod.terminal_rewards(task, trunc)
  with pytest.raises(ValueError, match="mode"):
    adv_mod.terminal_rewards(task, trunc, final_v, mode="drop")


def test_bootstrap_reward_equals_gae_bootstrap_at_gamma_one(data):
  """Report formulation (reward V(s_T) for truncated responses, terminal GAE) == classic GAE bootstrapping
  from V(s_T) with reward 0, when gamma = 1; with gamma < 1 they differ by the factor gamma on V(s_T)."""
  _, values, mask, lengths = data
  task = np.array([1.0, 0.0, 1.0, 1.0, 0.0], F32)
  trunc = np.array([True, False, True, False, True])
  final_v = adv_mod.value_after_last(values, mask)
  r_boot = adv_mod.place_terminal_reward(adv_mod.terminal_rewards(task, trunc, final_v), mask)
  r_zero = adv_mod.place_terminal_reward(adv_mod.terminal_rewards(task, trunc, mode="zero"), mask)
  for lam in (1.0, 0.9):
    a1, _ = adv_mod.gae_advantages(r_boot, values, mask, 1.0, lam)
    a2, _ = adv_mod.gae_advantages(r_zero, values, mask, 1.0, lam, bootstrap=trunc)
    np.testing.assert_allclose(a1, a2, rtol=1e-6, atol=1e-6)
  a1, _ = adv_mod.gae_advantages(r_boot, values, mask, 1.0, 1.0)
  # truncated row 0 (length 8): A_t = V(s_T) - V(s_t)
  np.testing.assert_allclose(a1[0], values[0, 8] - values[0, :8], rtol=1e-6, atol=1e-6)
  a1, _ = adv_mod.gae_advantages(r_boot, values, mask, 0.9, 1.0)
  a2, _ = adv_mod.gae_advantages(r_zero, values, mask, 0.9, 1.0, bootstrap=trunc)
  np.testing.assert_allclose(a1[0, 7] - a2[0, 7], 0.1 * values[0, 8], rtol=1e-5)


def test_bad_inputs_raise(data):
  rewards, values, mask, _ = data
  msg = r"gae_advantages: .*values has shape \[5, 8\], must be \[B, T\+1\] = \[5, 9\]"
  with pytest.raises(ValueError, match=msg):
    adv_mod.gae_advantages(rewards, values[:, :-1], mask)
  with pytest.raises(ValueError, match=r"rewards is float16, expected float32.*Got: rewards float16\[5, 8\]"):
    adv_mod.gae_advantages(rewards.astype(np.float16), values, mask)
  with pytest.raises(ValueError, match=r"mask has shape \[5, 7\], must match rewards \[5, 8\]"):
    jax.jit(adv_mod.gae_advantages)(rewards, values, mask[:, :-1])
  with pytest.raises(ValueError, match=r"bootstrap has shape \[4\], must be \[B\] = \[5\]"):
    adv_mod.gae_advantages(rewards, values, mask, bootstrap=np.ones(4, bool))
  with pytest.raises(ValueError, match=r"seq_rewards has shape \[4\]"):
    adv_mod.place_terminal_reward(np.ones(4, F32), mask)
  with pytest.raises(ValueError, match=r"final_values has shape \[3\], must match task_rewards \[4\]"):
    adv_mod.terminal_rewards(np.ones(4, F32), np.zeros(4, bool), np.ones(3, F32))
  with pytest.raises(ValueError, match=r"truncated must be bool, integer or float32/float64, is float16"):
    adv_mod.terminal_rewards(np.ones(4, F32), np.zeros(4, np.float16), mode="zero")
