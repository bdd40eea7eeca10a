"""Critic-side targets: GAE and truncation-aware value bootstrapping (docs/rl.md §6-7).

Value convention (one for the whole package): ``values`` is float32 [B, T+1] over the response slots,
``values[b, t] = V(s_t)``, the critic's value of the state *before* response token t is emitted (t < T), i.e. the
critic output at the position of the token preceding a_t. The state after the last valid response token
(index n = last_valid + 1, <= T; for right padding n is the response length) is s_n and ``values[b, n]`` is its
value V(s_n) -- the "V(s_T)" of the report. It is used only (a) as the terminal reward of truncated responses via
``terminal_rewards(..., mode="bootstrap")`` (the report's formulation) or (b) as a GAE bootstrap via
``gae_advantages(..., bootstrap=truncated)`` (classic RL bootstrapping). Use one or the other, never both; they
coincide for gamma = 1. With right padding and full-length responses (n = T) the extra column T holds V(s_T).

``mask`` [B, T] (bool / integer / float32) is nonzero on valid response tokens (treated as 0/1). Masked steps are
skipped by GAE (they get advantage 0 and pass the running value/advantage through unchanged, without
discounting), so multi-turn masks with holes (tool outputs) work; rewards at masked positions are ignored.
All outputs are stop-gradient constants.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stepflash_jax.rl.checks import check_arrays, fail

sg = jax.lax.stop_gradient

TERMINAL_MODES = ("bootstrap", "zero", "task")


def last_valid_index(mask):
  """mask [B, T] -> int32 [B]: index of the last valid token, -1 for rows without valid tokens."""
  (mask,) = check_arrays("last_valid_index", {"mask": mask})
  valid = mask != 0
  T = valid.shape[1]
  last = T - 1 - jnp.argmax(valid[:, ::-1], axis=-1)
  return jnp.where(valid.any(-1), last, -1).astype(jnp.int32)


def value_after_last(values, mask):
  """V(s_n) of the state after the last valid token: values [B, T+1], mask [B, T] -> float32 [B],
  values[b, last_valid + 1] (values[b, 0] for rows without valid tokens). Stop-gradient."""
  fn = "value_after_last"
  if jnp.ndim(mask) != 2:
    fail(fn, "mask must be [B, T]", {"values": values, "mask": mask})
  B, T = jnp.shape(mask)
  (values,) = check_arrays(
    fn, {"values": values}, masks=(), shape=(B, T + 1), expect="[B, T+1]", context={"mask": mask}
  )
  idx = last_valid_index(mask) + 1
  return sg(jnp.take_along_axis(values, idx[:, None], axis=1)[:, 0])


def place_terminal_reward(seq_rewards, mask):
  """Put a per-sequence reward at the last valid token: seq_rewards float32 [B], mask [B, T] -> float32 [B, T]
  (zero elsewhere; an all-masked row stays zero)."""
  fn = "place_terminal_reward"
  (mask,) = check_arrays(fn, {"mask": mask})
  (seq_rewards,) = check_arrays(
    fn, {"seq_rewards": seq_rewards}, ndim=1, masks=(), shape=mask.shape[:1], expect="[B]", context={"mask": mask}
  )
  last = last_valid_index(mask)
  hit = jnp.arange(mask.shape[1])[None, :] == last[:, None]
  return jnp.where(hit, seq_rewards[:, None], 0.0).astype(jnp.float32)


def terminal_rewards(task_rewards, truncated, final_values=None, mode="bootstrap"):
  """Truncation-aware terminal reward per sequence (docs/rl.md §7), all [B]:

    mode="bootstrap": truncated ? sg(final_values) : task_rewards   (report: reward V(s_T) for a response cut
                      off by the length limit; final_values = ``value_after_last(values, mask)``)
    mode="zero":      truncated ? 0 : task_rewards                   (ablation)
    mode="task":      task_rewards                                   (truncation ignored)

  task_rewards float32 [B]; truncated bool/integer/float32 [B] (nonzero = cut off by the length limit);
  final_values float32 [B] (needed only for "bootstrap"). Returns float32 [B].
  """
  fn = "terminal_rewards"
  if mode not in TERMINAL_MODES:
    raise ValueError(f"{fn}: mode must be one of {TERMINAL_MODES}, got {mode!r}")
  arrays = {"task_rewards": task_rewards, "truncated": truncated}
  if mode == "bootstrap":
    if final_values is None:
      raise ValueError(f"{fn}: mode='bootstrap' needs final_values (V(s_T) per sequence, float32 [B])")
    arrays["final_values"] = final_values
  checked = check_arrays(fn, arrays, ndim=1, masks=("truncated",))
  task_rewards, truncated = checked[0], checked[1] != 0
  if mode == "task":
    return task_rewards
  if mode == "zero":
    return jnp.where(truncated, 0.0, task_rewards)
  return jnp.where(truncated, sg(checked[2]), task_rewards)


def gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, bootstrap=None):
  """Generalised advantage estimation over valid response tokens (reverse lax.scan):

      delta_t = r_t + gamma * V_next - V(s_t),   A_t = delta_t + gamma * lam * A_next,   R_t = A_t + V(s_t)

  where V_next / A_next are those of the next *valid* step; after the last valid token V_next = V(s_n) if
  bootstrap[b] else 0 (terminal) and A_next = 0. Masked steps get A = R = 0. With gamma = lam = 1 and a terminal
  reward R at the last valid token (``place_terminal_reward``), A_t = R - V(s_t).

  Args: rewards float32 [B, T]; values float32 [B, T+1] (see module docstring); mask [B, T];
    bootstrap optional bool/integer/float32 [B] (default: every sequence ends in a terminal state).
  Returns (advantages, returns), float32 [B, T], stop-gradient.
  """
  fn = "gae_advantages"
  rewards, mask = check_arrays(fn, {"rewards": rewards, "mask": mask})
  B, T = rewards.shape
  (values,) = check_arrays(
    fn, {"values": values}, masks=(), shape=(B, T + 1), expect="[B, T+1]", context={"rewards": rewards, "mask": mask}
  )
  valid = mask != 0
  v_next0 = jnp.zeros((B,), jnp.float32)
  if bootstrap is not None:
    (bootstrap,) = check_arrays(
      fn, {"bootstrap": bootstrap}, ndim=1, masks=("bootstrap",), shape=(B,), expect="[B]", context={"rewards": rewards}
    )
    v_next0 = jnp.where(bootstrap != 0, value_after_last(values, mask), 0.0)
  rewards, values = sg(rewards), sg(values)
  gamma, lam = jnp.float32(gamma), jnp.float32(lam)

  def step(carry, xs):
    v_next, a_next = carry
    r, v, ok = xs
    delta = r + gamma * v_next - v
    a = delta + gamma * lam * a_next
    carry = (jnp.where(ok, v, v_next), jnp.where(ok, a, a_next))
    return carry, jnp.where(ok, a, 0.0)

  xs = (jnp.where(valid, rewards, 0.0).T, jnp.where(valid, values[:, :T], 0.0).T, valid.T)
  _, adv = jax.lax.scan(step, (v_next0, jnp.zeros((B,), jnp.float32)), xs, reverse=True)
  adv = adv.T
  returns = jnp.where(valid, adv + values[:, :T], 0.0)
  return adv, returns
