"""MTP-K speculative decoding: draft with the MTP modules, verify with the backbone (see engine.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from stepflash_jax.model.cache import init_cache
from stepflash_jax.sampling.calls import (
  cast_variables,
  empty_expert_ids,
  model_call,
  mtp_call,
  record_expert_ids,
  rollback,
)
from stepflash_jax.sampling.plain import Sampling, Shapes, accumulate, prefill_inputs, result
from stepflash_jax.sampling.sample import draw, is_stop, noisy, sampling_logprobs


def _stack(hs, like):
  """[K-1] x [B, H] -> [K-1, B, H] (empty for K = 1)."""
  return jnp.stack(hs, 0) if hs else jnp.zeros((0,) + like.shape, like.dtype)


def draft_prefill(a, v, mcache, hid, ext, pos, seg, s, sample):
  """MTP chain over the prompt columns right after the backbone prefill.

  hid [B, P, H] backbone hidden states, ext [B, P+1] = prompt columns + the first sampled token, pos/seg [B, P],
  s [B] = last prompt position. Module k at column c reads token column c+k+1 (the last k columns read the drafts
  d_1..d_k); its entries at positions > s-k read drafts and are rolled back. sample(k, logits [B, V]) ->
  (d_{k+1} [B], log q(d), log q [B, V]). Returns (drafts [B, K], log q [B, K, V], carries [K-1, B, H] = h_k at
  position s-k, new mcache, per-module logits [B, P, V])."""
  P, K = hid.shape[1], len(mcache)
  h, drafts, lq, carries, mcache, logits = hid, [], [], [], list(mcache), []
  for k in range(K):
    h, lg, mc = mtp_call(a, v, k, h, ext[:, k + 1 : k + 1 + P], pos, seg, mcache[k], 0)
    mcache[k] = rollback(mc, s - k)
    d, _, lqk = sample(k, lg[:, -1])
    drafts.append(d), lq.append(lqk), carries.append(h[:, P - 1 - k]), logits.append(lg)
    ext = jnp.concatenate([ext, d[:, None]], 1)
  return jnp.stack(drafts, 1), jnp.stack(lq, 1), _stack(carries[: K - 1], hid[:, 0]), mcache, logits


def draft_step(a, v, mcache, carries, hid, Z, s, n, pad, live, sample):
  """MTP chain after a verify call at positions s+1..s+K+1 that accepted n [B] drafts (s_new = s+1+n).

  hid [B, K+1, H] verify hidden states; Z [B, 2K] = tokens at positions s+2.. (valid for j <= n, the rest are
  replaced by the drafts as they are drawn); carries [K-1, B, H]: h_{k-1} at position s-k+1 (k >= 1); pad [B] left
  padding (column = position + pad); live [B] rows still generating. Module k runs positions s-k+1 .. s+K+1 (K+1+k
  columns, valid up to s_new) on tokens Z[:K+1+k]; its entries past s_new-k read drafts and are rolled back; the
  draft d_{k+1} comes from its logits at s_new. Returns like `draft_prefill` (per-module logits [B, K+1+k, V])."""
  K = len(mcache)
  take = lambda x, idx: jnp.take_along_axis(x, idx, axis=1)
  jz = jnp.arange(Z.shape[1])
  Z = jnp.where(jz <= n[:, None], Z, 0)
  s_new = s + 1 + n
  h, drafts, lq, new_c, mcache, logits = hid, [], [], [], list(mcache), []
  for k in range(K):
    jk = jnp.arange(K + 1 + k)
    kpos = (s - k + 1)[:, None] + jk
    kseg = (live[:, None] & (jk <= (n + k)[:, None]) & (kpos >= 0)).astype(jnp.int32)
    if k:
      h = jnp.concatenate([carries[k - 1][:, None], h], 1)
    h, lg, mc = mtp_call(a, v, k, h, Z[:, : K + 1 + k], jnp.maximum(kpos, 0), kseg, mcache[k], s - k + 1 + pad)
    mcache[k] = rollback(mc, s_new - k)
    d, _, lqk = sample(k, take(lg, (n + k)[:, None, None])[:, 0])  # at position s_new
    Z = jnp.where(jz == (n + k + 1)[:, None], d[:, None], Z)
    drafts.append(d), lq.append(lqk), new_c.append(take(h, n[:, None, None])[:, 0]), logits.append(lg)
  return jnp.stack(drafts, 1), jnp.stack(lq, 1), _stack(new_c[: K - 1], hid[:, 0]), mcache, logits


def accept_drafts(lp, lq, drafts, greedy, key_accept, key_resample):
  """Speculative acceptance: d_j kept with prob min(1, p_{j-1}(d_j) / q_j(d_j)) (greedy: iff d_j = argmax p_{j-1});
  at the first rejection n the next token is drawn from normalise(max(0, p_n - q_{n+1})), after K acceptances from
  p_K. lp [B, K+1, V] log p_0..p_K, lq [B, K, V] log q_1..q_K, drafts [B, K] ->
  (n [B] accepted drafts, t_new [B] next token, its log p, log p of each draft [B, K])."""
  B, K = drafts.shape
  take = lambda x, idx: jnp.take_along_axis(x, idx, axis=1)
  lp_d = jnp.take_along_axis(lp[:, :K], drafts[..., None], -1)[..., 0]
  lq_d = jnp.take_along_axis(lq, drafts[..., None], -1)[..., 0]
  u = jax.random.uniform(key_accept, (B, K), minval=1e-30)
  acc = jnp.where(greedy, drafts == jnp.argmax(lp[:, :K], -1), jnp.log(u) < lp_d - lq_d)
  n = jnp.sum(jnp.cumprod(acc.astype(jnp.int32), 1), 1)
  p_n = take(lp, n[:, None, None])[:, 0]
  q_n = jnp.where((n < K)[:, None], jnp.exp(take(lq, jnp.minimum(n, K - 1)[:, None, None])[:, 0]), 0.0)
  resid = jnp.maximum(jnp.exp(p_n) - q_n, 0.0)
  resid = jnp.where(resid.sum(-1, keepdims=True) > 0, resid, jnp.exp(p_n))
  t_new = jnp.where(greedy, jnp.argmax(p_n, -1), jax.random.categorical(key_resample, jnp.log(resid), -1))
  t_new = t_new.astype(jnp.int32)
  return n, t_new, take(p_n, t_new[:, None])[:, 0], lp_d


def _prefill(st: Shapes, v, prompts, lens, sampling: Sampling, rng, sampler):
  """Backbone over the prompt, first token from p, then the MTP chain over the prompt columns -> (loop state, left
  padding [B], routing confidence of the prefill)."""
  a, P, N = st.args, st.max_prompt_len, st.max_new_tokens
  temp, top_p, noise, eos, pad_id = sampling
  K, B = len(a.mtp_layers), prompts.shape[0]
  C = P + N + K + 2
  pad, pos, seg = prefill_inputs(st, lens)
  logits, hid, cache, conf_p, _, ids = model_call(a, v, prompts, pos, seg, init_cache(a, B, C, K), 0)
  mcache = init_cache(a, B, C, K + 1, mtp=True)["mtp"]
  k0 = jax.random.split(jax.random.fold_in(rng, 0), K + 2)
  tok0, lp0 = draw(k0[1], sampling_logprobs(noisy(k0[0], logits[:, -1], noise), temp, top_p), temp <= 0)
  s = lens - 1
  drafts, lq, carries, mcache, _ = draft_prefill(
    a, v, mcache, hid, jnp.concatenate([prompts, tok0[:, None]], 1), pos, seg, s, sampler(k0[2:])
  )
  toks = jnp.full((B, C), pad_id, jnp.int32).at[:, :P].set(prompts).at[:, P].set(tok0)
  state = dict(
    it=jnp.int32(0),
    cache=cache,
    mcache=mcache,
    toks=toks,
    logp=jnp.zeros((B, C), jnp.float32).at[:, P].set(lp0),
    s=s,
    g=jnp.ones((B,), jnp.int32),
    done=is_stop(tok0, eos) | (N <= 1),
    drafts=drafts,
    lq=lq,
    carries=carries,
    conf=jax.tree.map(jnp.zeros_like, conf_p),
    ntok=jnp.float32(0),
    ids=record_expert_ids(empty_expert_ids(a, B, C), ids, 0),
    accepted=jnp.int32(0),
    proposed=jnp.int32(0),
    calls=jnp.int32(0),
  )
  return state, pad, conf_p


def _spec_result(st: Shapes, S, prompts, eos, pad_id, conf_p) -> dict:
  """The engine's output dict from the final loop state (plus accept_rate, tokens_per_call, num_steps)."""
  P, N, B = st.max_prompt_len, st.max_new_tokens, prompts.shape[0]
  resp = S["toks"][:, P : P + N]
  mask = (jnp.arange(N)[None] < S["g"][:, None]).astype(jnp.float32)
  out = result(
    st,
    eos,
    prompts,
    jnp.where(mask > 0, resp, pad_id),
    S["logp"][:, P : P + N],
    mask,
    S["conf"],
    S["ntok"],
    conf_p,
    S["ids"],
  )
  out.update(
    accept_rate=S["accepted"] / jnp.maximum(S["proposed"], 1),
    tokens_per_call=S["g"].sum() / (B + S["calls"]),
    num_steps=S["it"],
  )
  return out


def generate_spec(st: Shapes, variables, prompts, lens, sampling: Sampling, rng):
  """MTP-K speculative generation (engine.py docstring): prefill, then a while_loop of verify + draft steps."""
  a, P, N = st.args, st.max_prompt_len, st.max_new_tokens
  temp, top_p, noise, eos, pad_id = sampling
  K = len(a.mtp_layers)
  B = prompts.shape[0]
  C = P + N + K + 2  # columns: every verify/draft write stays below C
  greedy = temp <= 0
  v = cast_variables(variables, a.dtype, st.quantize)
  rows = jnp.arange(B)[:, None]
  take = lambda x, idx: jnp.take_along_axis(x, idx, axis=1)

  def sampler(keys):  # the draft distribution q: temperature / top-p, no logit noise
    def sample(k, logits):
      lq = sampling_logprobs(logits, temp, top_p)
      return draw(keys[k], lq, greedy) + (lq,)

    return sample

  state, pad, conf_p = _prefill(st, v, prompts, lens, sampling, rng, sampler)

  def body(S):
    active, s, drafts, lq = ~S["done"], S["s"], S["drafts"], S["lq"]
    keys = jax.random.split(jax.random.fold_in(rng, S["it"] + 1), K + 3)
    # Verify [x_{s+1}, d_1..d_K] at positions s+1..s+K+1, columns s+1+pad.. (per row).
    j1 = jnp.arange(K + 1)
    x1 = take(S["toks"], (s + 1 + pad)[:, None])
    vseg = jnp.broadcast_to(active[:, None], (B, K + 1)).astype(jnp.int32)
    logits, hid, cache, conf, ntok, ids = model_call(
      a, v, jnp.concatenate([x1, drafts], 1), s[:, None] + 1 + j1, vseg, S["cache"], s + 1 + pad
    )
    lp = sampling_logprobs(noisy(keys[0], logits, noise), temp, top_p)  # p_0..p_K [B, K+1, V]
    n, t_new, lp_new, lp_d = accept_drafts(lp, lq, drafts, greedy, keys[1], keys[2])
    # Commit d_1..d_n, t_new (stop after EOS and at N tokens).
    dpad = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], 1)
    ctok = jnp.where(j1 < n[:, None], dpad, t_new[:, None])
    clp = jnp.where(j1 < n[:, None], jnp.concatenate([lp_d, jnp.zeros((B, 1))], 1), lp_new[:, None])
    is_eos = is_stop(ctok, eos) & (j1 <= n[:, None])
    eos_cap = jnp.where(is_eos.any(1), jnp.argmax(is_eos, 1) + 1, K + 1)
    n_commit = jnp.where(active, jnp.minimum(jnp.minimum(n + 1, N - S["g"]), eos_cap), 0)
    wmask, wcol = j1 < n_commit[:, None], (s + 2 + pad)[:, None] + j1
    toks = S["toks"].at[rows, wcol].set(jnp.where(wmask, ctok, take(S["toks"], wcol)))
    logp = S["logp"].at[rows, wcol].set(jnp.where(wmask, clp, take(S["logp"], wcol)))
    g = S["g"] + n_commit
    done = S["done"] | (is_eos & wmask).any(1) | (g >= N)
    s_new = jnp.where(active, s + 1 + n, s)
    cache = rollback(cache, s_new)
    # Draft: tokens Z = x_{s+2}..x_{s_new+1} (committed), then the drafts as they are drawn.
    jz = jnp.arange(2 * K)
    Z = take(toks, jnp.minimum((s + 2 + pad)[:, None] + jz, C - 1))
    drafts, lq, carries, mcache, _ = draft_step(
      a, v, S["mcache"], S["carries"], hid, Z, s, n, pad, ~done, sampler(keys[3:])
    )
    na = active.astype(jnp.int32)
    return dict(
      it=S["it"] + 1,
      cache=cache,
      mcache=mcache,
      toks=toks,
      logp=logp,
      s=s_new,
      g=g,
      done=done,
      drafts=drafts,
      lq=lq,
      carries=carries,
      conf=accumulate(S["conf"], conf, ntok),
      ntok=S["ntok"] + ntok,
      ids=record_expert_ids(S["ids"], ids, s + 1 + pad),  # rejected drafts' columns are rewritten by the next call
      accepted=S["accepted"] + jnp.sum(n * na),
      proposed=S["proposed"] + K * jnp.sum(na),
      calls=S["calls"] + jnp.sum(na),
    )

  S = lax.while_loop(lambda S: ~jnp.all(S["done"]) & (S["it"] < N), body, state)
  return _spec_result(st, S, prompts, eos, pad_id, conf_p)
