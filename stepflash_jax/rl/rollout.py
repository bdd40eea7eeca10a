"""Rollout ("inference") engine: KV-cached sampling with its own numerics. Its log-probs are pi_vllm (STEP35.md §3).

    engine = RolloutEngine(cfg, max_prompt_len=32, max_new_tokens=64, eos_id=tok.eos_id, pad_id=tok.pad_id,
                           dtype="bfloat16", temperature=1.0, top_p=1.0, logit_noise=0.0, spec_decode=False)
    out = engine.generate(variables, prompts, prompt_lens, jax.random.key(0))     # prompts [B, P] LEFT-padded

Output dict (N = max_new_tokens, P = max_prompt_len):
  tokens [B, P + N] int32      prompt (left-padded to P) + response
  response [B, N] int32        pad_id after the EOS token / after the row stopped
  response_mask [B, N] f32     1 on generated tokens (incl. the EOS token), 0 after
  logp [B, N] f32              log-prob of each token under the distribution it was sampled from (after logit noise,
                               temperature, top-p); 0 where masked. Greedy (temperature 0): log-softmax at T = 1.
  lengths [B] int32, truncated [B] bool (no EOS within N)
  routing_confidence f32       Sigma_k of the rollout: mean over MoE layers of the sown "confidence", averaged over
                               decode calls weighted by their valid tokens (plain: the fed response tokens; spec:
                               every verified token incl. rejected drafts). routing_confidence_prompt: the prefill's.
  routing_confidence_layers    {MoE layer path: f32} the same per MoE layer (routing_confidence is their mean).
  spec only: accept_rate (accepted / proposed drafts), tokens_per_call (response tokens / main-model calls per row,
             prefill included; 1.0 for plain decoding), num_steps (verify iterations).

Numerics: dtype "bfloat16" runs the model with bf16 weights/activations/KV cache (router, norms, softmax and logits
stay fp32 inside the model); "float32" reproduces the training forward. Sampling: logits + logit_noise * N(0, 1)
(a controlled train/inference mismatch), then / temperature, then the top-p nucleus, renormalised.

Cache layout. Prompts are left-padded to P columns; row b has pad_b = P - len_b pad columns (segment 0, stored
position -1, never attended) and its token at position p lives in column p + pad_b of every cache (full-attention
layers: slot = column; sliding-window ring buffers: slot = column % S).
  * plain decoding: every row writes the common column P + i - 1 at step i (one lax.while_loop, early exit when all
    rows hit EOS);
  * MTP-K speculative decoding (K = 3): rows advance by different amounts, so every call writes at per-row columns
    (cache_index int [B]). Rejected drafts are rolled back by *position*: after a verify call every cache entry with a
    position beyond the row's last accepted one is marked empty (pos = -1), and the next call overwrites its slots.
    Ring buffers keep window + K (main) / window + K + 1 (MTP) slots so no entry still inside a window is evicted.

Speculative step (positions; s = last position already in the main cache, x_{s+1} the next, committed token):
  verify: main model on [x_{s+1}, d_1..d_K] at s+1..s+K+1 -> p_0..p_K; accept d_j with prob min(1, p_{j-1}(d_j) /
    q_j(d_j)) (greedy: iff d_j = argmax p_{j-1}); at the first rejection j sample normalise(max(0, p_{j-1} - q_j)),
    after K acceptances sample a bonus token from p_K, so every committed token is distributed exactly as p. logp is
    log p of the committed token; commits stop at EOS and at N tokens.
  draft: MTP module k at position t reads h_{k-1}(t) (h_{-1} = backbone hidden) and token t+k+1, predicts t+k+2.
    Module k keeps a cache of its entries at positions <= s_new - k (those whose inputs are all committed tokens);
    each step it runs K+1+k columns from position s-k+1 (valid up to s_new = s+1+n, masked per row; module k >= 1
    gets h_{k-1}(s-k+1) carried over from the previous step). Its output at s_new gives q_{k+1} (temperature /
    top-p, no noise) and the draft d_{k+1}; entries that read drafts are rolled back. With drafts equal to the true
    tokens every entry equals the training forward's MTP output (tests/test_rollout.py).

generate() is one jitted XLA program (prefill + lax.while_loop of decode / verify steps), compiled once per
(model, dtype, P, N, spec_decode, batch size) and shared by engines that differ only in temperature / top_p /
logit_noise / eos / pad (traced inputs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from stepflash_jax import model as M
from stepflash_jax.config import ModelArgs
from stepflash_jax.model.cache import init_cache
from stepflash_jax.model.moe import stat_layers

DTYPES = ("bfloat16", "float32")
# XLA options that halve CPU compile time (slower code): for tests and short runs.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


# ----------------------------------------------------------------------------------------------------------------
# Sampling


def sampling_logprobs(logits, temperature, top_p):
  """logits [..., V] -> fp32 log-probs [..., V] of softmax(logits / T) restricted to the top-p nucleus (the
  smallest set of most likely tokens with mass >= top_p; ties at the boundary kept), renormalised.
  temperature <= 0 (greedy) uses T = 1, top_p >= 1 skips the nucleus."""
  t = jnp.where(temperature > 0, temperature, 1.0)
  lp = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)

  def nucleus(lp):
    srt = -jnp.sort(-lp, axis=-1)
    before = jnp.cumsum(jnp.exp(srt), -1) - jnp.exp(srt)  # mass of the more likely tokens
    thresh = jnp.min(jnp.where(before < top_p, srt, jnp.inf), -1, keepdims=True)
    return jax.nn.log_softmax(jnp.where(lp >= thresh, lp, -jnp.inf), -1)

  return lax.cond(top_p < 1.0, nucleus, lambda x: x, lp)


def _noisy(key, logits, std):
  return lax.cond(
    std > 0, lambda l: l + std * jax.random.normal(key, l.shape, jnp.float32), lambda l: l, logits.astype(jnp.float32)
  )


def _draw(key, lp, greedy):
  """lp [..., V] -> (token [...] int32, its log-prob [...])."""
  tok = jnp.where(greedy, jnp.argmax(lp, -1), jax.random.categorical(key, lp, -1)).astype(jnp.int32)
  return tok, jnp.take_along_axis(lp, tok[..., None], -1)[..., 0]


# ----------------------------------------------------------------------------------------------------------------
# Model calls


def cast_variables(variables, dtype):
  """Weight matrices and the embedding to `dtype`; router kernels, norm scales and router biases stay fp32."""

  def f(path, x):
    names = [str(getattr(p, "key", "")) for p in path]
    if names[-1] in ("kernel", "embedding") and "router" not in names:
      return x.astype(dtype)
    return x

  return {
    c: (jax.tree_util.tree_map_with_path(f, variables[c]) if c == "params" else variables[c])
    for c in M.COLLECTIONS
    if c in variables
  }


def _moe_confidence(stats):
  """({MoE layer: sown routing confidence}, valid tokens it averages over) for one model call."""
  toks = stat_layers(stats, "tokens")
  return stat_layers(stats, "confidence"), (next(iter(toks.values())) if toks else jnp.float32(0))


def model_call(args, v, tokens, positions, segment_ids, cache, cache_index):
  """Cached backbone call -> (logits [B, T, V] fp32, hidden [B, T, H], new cache, {MoE layer: confidence}, tokens)."""
  out, st = M.apply(
    args, v, tokens, positions=positions, segment_ids=segment_ids, cache=cache, cache_index=cache_index, stats=True
  )
  conf, ntok = _moe_confidence(st)
  return out["logits"], out["hidden"], out["cache"], conf, ntok


def _mtp(args, v, k, h, tokens, positions, segment_ids, cache, cache_index):
  return M.build(args).apply(
    {c: v[c] for c in M.COLLECTIONS if c in v},
    k,
    h,
    tokens,
    positions,
    segment_ids,
    cache,
    cache_index,
    method="mtp_step",
  )


def rollback(cache, last_pos):
  """Mark every cache entry with a position > last_pos [B] empty (pos = -1): rejected drafts disappear."""

  def f(path, x):
    if str(getattr(path[-1], "key", "")) != "pos":
      return x
    return jnp.where(x > last_pos[:, None], -1, x)  # pos is [..., B, S]

  return jax.tree_util.tree_map_with_path(f, cache)


# ----------------------------------------------------------------------------------------------------------------
# The compiled generate functions (shared by engines with equal static settings)


@dataclasses.dataclass(frozen=True)
class _Static:
  args: ModelArgs
  P: int
  N: int


def _prefill_inputs(st, lens):
  """-> pad [B], positions [B, P] (0 at a row's first real token; pad columns get 0 but segment 0), segments."""
  col = jnp.arange(st.P)[None]
  pad = st.P - lens
  return pad, jnp.maximum(col - pad[:, None], 0), (col >= pad[:, None]).astype(jnp.int32)


def _result(st, eos, prompts, resp, logp, mask, conf, ntok, conf_p):
  has_eos = jnp.any((resp == eos) & (mask > 0), axis=1)
  return {
    "tokens": jnp.concatenate([prompts, resp], 1),
    "response": resp,
    "response_mask": mask,
    "logp": logp * mask,
    "lengths": mask.sum(1).astype(jnp.int32),
    "truncated": ~has_eos,
    "routing_confidence": _layer_mean(conf) / jnp.maximum(ntok, 1.0),
    "routing_confidence_layers": {k: c / jnp.maximum(ntok, 1.0) for k, c in conf.items()},
    "routing_confidence_prompt": _layer_mean(conf_p),
  }


def _layer_mean(conf: dict):
  return jnp.mean(jnp.stack(list(conf.values()))) if conf else jnp.float32(0)


def _accumulate(total: dict, conf: dict, ntok):
  """Token-weighted running sum of the per-layer routing confidence of the decode calls."""
  return {k: total[k] + conf[k] * ntok for k in total}


def _generate_plain(st: _Static, variables, prompts, lens, knobs, ids, rng):
  a, P, N = st.args, st.P, st.N
  eos, pad_id = ids[0], ids[1]
  B = prompts.shape[0]
  temp, top_p, noise = knobs[0], knobs[1], knobs[2]
  v = cast_variables(variables, a.dtype)
  _, pos, seg = _prefill_inputs(st, lens)
  logits, _, cache, conf_p, _ = model_call(a, v, prompts, pos, seg, init_cache(a, B, P + N), 0)

  def sample(i, logits):
    kn, ks = jax.random.split(jax.random.fold_in(rng, i))
    return _draw(ks, sampling_logprobs(_noisy(kn, logits, noise), temp, top_p), temp <= 0)

  tok, lp = sample(0, logits[:, -1])
  s = dict(
    i=jnp.int32(1),
    cache=cache,
    done=tok == eos,
    conf=jax.tree.map(jnp.zeros_like, conf_p),
    ntok=jnp.float32(0),
    resp=jnp.full((B, N), pad_id, jnp.int32).at[:, 0].set(tok),
    logp=jnp.zeros((B, N), jnp.float32).at[:, 0].set(lp),
    mask=jnp.zeros((B, N), jnp.float32).at[:, 0].set(1.0),
  )

  def body(s):
    i, active = s["i"], ~s["done"]
    tok_in = lax.dynamic_slice_in_dim(s["resp"], i - 1, 1, axis=1)
    logits, _, cache, conf, ntok = model_call(
      a, v, tok_in, (lens + i - 1)[:, None], active[:, None].astype(jnp.int32), s["cache"], P + i - 1
    )
    tok, lp = sample(i, logits[:, 0])
    tok = jnp.where(active, tok, pad_id)
    put = lambda buf, x: lax.dynamic_update_slice_in_dim(buf, x[:, None].astype(buf.dtype), i, axis=1)
    return dict(
      i=i + 1,
      cache=cache,
      done=s["done"] | (active & (tok == eos)),
      conf=_accumulate(s["conf"], conf, ntok),
      ntok=s["ntok"] + ntok,
      resp=put(s["resp"], tok),
      logp=put(s["logp"], jnp.where(active, lp, 0.0)),
      mask=put(s["mask"], active.astype(jnp.float32)),
    )

  s = lax.while_loop(lambda s: (s["i"] < N) & ~jnp.all(s["done"]), body, s)
  return _result(st, eos, prompts, s["resp"], s["logp"], s["mask"], s["conf"], s["ntok"], conf_p)


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
    h, lg, mc = _mtp(a, v, k, h, ext[:, k + 1 : k + 1 + P], pos, seg, mcache[k], 0)
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
    h, lg, mc = _mtp(a, v, k, h, Z[:, : K + 1 + k], jnp.maximum(kpos, 0), kseg, mcache[k], s - k + 1 + pad)
    mcache[k] = rollback(mc, s_new - k)
    d, _, lqk = sample(k, take(lg, (n + k)[:, None, None])[:, 0])  # at position s_new
    Z = jnp.where(jz == (n + k + 1)[:, None], d[:, None], Z)
    drafts.append(d), lq.append(lqk), new_c.append(take(h, n[:, None, None])[:, 0]), logits.append(lg)
  return jnp.stack(drafts, 1), jnp.stack(lq, 1), _stack(new_c[: K - 1], hid[:, 0]), mcache, logits


def _generate_spec(st: _Static, variables, prompts, lens, knobs, ids, rng):
  a, P, N = st.args, st.P, st.N
  eos, pad_id = ids[0], ids[1]
  K = len(a.mtp_layers)
  B = prompts.shape[0]
  C = P + N + K + 2  # columns: every verify/draft write stays below C
  temp, top_p, noise = knobs[0], knobs[1], knobs[2]
  greedy = temp <= 0
  v = cast_variables(variables, a.dtype)
  rows = jnp.arange(B)[:, None]
  take = lambda x, idx: jnp.take_along_axis(x, idx, axis=1)

  def sampler(keys):  # the draft distribution q: temperature / top-p, no logit noise
    def sample(k, logits):
      lq = sampling_logprobs(logits, temp, top_p)
      return _draw(keys[k], lq, greedy) + (lq,)

    return sample

  # Prefill: backbone over the prompt, first token from p, then the MTP chain over the prompt columns.
  pad, pos, seg = _prefill_inputs(st, lens)
  logits, hid, cache, conf_p, _ = model_call(a, v, prompts, pos, seg, init_cache(a, B, C, K), 0)
  mcache = init_cache(a, B, C, K + 1, mtp=True)["mtp"]
  k0 = jax.random.split(jax.random.fold_in(rng, 0), K + 2)
  tok0, lp0 = _draw(k0[1], sampling_logprobs(_noisy(k0[0], logits[:, -1], noise), temp, top_p), greedy)
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
    done=(tok0 == eos) | (N <= 1),
    drafts=drafts,
    lq=lq,
    carries=carries,
    conf=jax.tree.map(jnp.zeros_like, conf_p),
    ntok=jnp.float32(0),
    accepted=jnp.int32(0),
    proposed=jnp.int32(0),
    calls=jnp.int32(0),
  )

  def body(S):
    active, s, drafts, lq = ~S["done"], S["s"], S["drafts"], S["lq"]
    keys = jax.random.split(jax.random.fold_in(rng, S["it"] + 1), K + 3)
    # Verify [x_{s+1}, d_1..d_K] at positions s+1..s+K+1, columns s+1+pad.. (per row).
    j1 = jnp.arange(K + 1)
    x1 = take(S["toks"], (s + 1 + pad)[:, None])
    vseg = jnp.broadcast_to(active[:, None], (B, K + 1)).astype(jnp.int32)
    logits, hid, cache, conf, ntok = model_call(
      a, v, jnp.concatenate([x1, drafts], 1), s[:, None] + 1 + j1, vseg, S["cache"], s + 1 + pad
    )
    lp = sampling_logprobs(_noisy(keys[0], logits, noise), temp, top_p)  # p_0..p_K [B, K+1, V]
    lp_d = jnp.take_along_axis(lp[:, :K], drafts[..., None], -1)[..., 0]
    lq_d = jnp.take_along_axis(lq, drafts[..., None], -1)[..., 0]
    u = jax.random.uniform(keys[1], (B, K), minval=1e-30)
    acc = jnp.where(greedy, drafts == jnp.argmax(lp[:, :K], -1), jnp.log(u) < lp_d - lq_d)
    n = jnp.sum(jnp.cumprod(acc.astype(jnp.int32), 1), 1)  # accepted drafts [B]
    p_n = take(lp, n[:, None, None])[:, 0]
    q_n = jnp.where((n < K)[:, None], jnp.exp(take(lq, jnp.minimum(n, K - 1)[:, None, None])[:, 0]), 0.0)
    resid = jnp.maximum(jnp.exp(p_n) - q_n, 0.0)
    resid = jnp.where(resid.sum(-1, keepdims=True) > 0, resid, jnp.exp(p_n))
    t_new = jnp.where(greedy, jnp.argmax(p_n, -1), jax.random.categorical(keys[2], jnp.log(resid), -1))
    t_new = t_new.astype(jnp.int32)
    lp_new = take(p_n, t_new[:, None])[:, 0]
    # Commit d_1..d_n, t_new (stop after EOS and at N tokens).
    dpad = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], 1)
    ctok = jnp.where(j1 < n[:, None], dpad, t_new[:, None])
    clp = jnp.where(j1 < n[:, None], jnp.concatenate([lp_d, jnp.zeros((B, 1))], 1), lp_new[:, None])
    is_eos = (ctok == eos) & (j1 <= n[:, None])
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
      conf=_accumulate(S["conf"], conf, ntok),
      ntok=S["ntok"] + ntok,
      accepted=S["accepted"] + jnp.sum(n * na),
      proposed=S["proposed"] + K * jnp.sum(na),
      calls=S["calls"] + jnp.sum(na),
    )

  S = lax.while_loop(lambda S: ~jnp.all(S["done"]) & (S["it"] < N), body, state)
  resp = S["toks"][:, P : P + N]
  mask = (jnp.arange(N)[None] < S["g"][:, None]).astype(jnp.float32)
  out = _result(
    st, eos, prompts, jnp.where(mask > 0, resp, pad_id), S["logp"][:, P : P + N], mask, S["conf"], S["ntok"], conf_p
  )
  out.update(
    accept_rate=S["accepted"] / jnp.maximum(S["proposed"], 1),
    tokens_per_call=S["g"].sum() / (B + S["calls"]),
    num_steps=S["it"],
  )
  return out


@functools.lru_cache(maxsize=16)
def _compiled(st: _Static, spec: bool, options: tuple):
  gen = _generate_spec if spec else _generate_plain
  return jax.jit(functools.partial(gen, st), compiler_options=dict(options) or None)


@functools.lru_cache(maxsize=16)
def _compiled_call(args: ModelArgs, options: tuple):
  return jax.jit(
    lambda v, *xs: model_call(args, cast_variables(v, args.dtype), *xs), compiler_options=dict(options) or None
  )


# ----------------------------------------------------------------------------------------------------------------


class RolloutEngine:
  """Batched KV-cached generation (see the module docstring). The caller repeats prompts for N responses each.

  model_cfg: ConfigDict or ModelArgs of the trained model; the engine runs it in its own `dtype`.
  max_prompt_len P: prompts narrower than P are left-padded to P (one compilation per batch size).
  temperature 0 = greedy; top_p 1 = plain sampling; logit_noise = std of Gaussian noise added to the logits.
  spec_decode: MTP-K draft + verify (needs num_mtp_layers >= 1); same output distribution, fewer model calls.
  compiler_options: XLA options for jax.jit, e.g. FAST_COMPILE (tests, short CPU runs).
  Engines that differ only in eos/pad ids and sampling knobs share one compiled program (they are traced inputs).
  """

  def __init__(
    self,
    model_cfg,
    *,
    max_prompt_len,
    max_new_tokens,
    eos_id,
    pad_id,
    dtype="bfloat16",
    temperature=1.0,
    top_p=1.0,
    logit_noise=0.0,
    spec_decode=False,
    compiler_options=None,
  ):
    base = M.as_args(model_cfg)
    for name, val in (("max_prompt_len", max_prompt_len), ("max_new_tokens", max_new_tokens)):
      if int(val) < 1:
        raise ValueError(f"{name} must be >= 1, got {val}")
    for name, val in (("eos_id", eos_id), ("pad_id", pad_id)):
      if not 0 <= int(val) < base.vocab_size:
        raise ValueError(f"{name} must lie in [0, vocab_size={base.vocab_size}), got {val}")
    if dtype not in DTYPES:
      raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
      raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if logit_noise < 0:
      raise ValueError(f"logit_noise must be >= 0, got {logit_noise}")
    if spec_decode and not base.mtp_layers:
      raise ValueError("spec_decode needs MTP modules: model config field 'num_mtp_layers' is 0")
    self.args = dataclasses.replace(base, dtype=jnp.dtype(dtype))
    self.max_prompt_len, self.max_new_tokens = int(max_prompt_len), int(max_new_tokens)
    self.eos_id, self.pad_id, self.dtype, self.spec_decode = int(eos_id), int(pad_id), dtype, bool(spec_decode)
    self.temperature, self.top_p, self.logit_noise = float(temperature), float(top_p), float(logit_noise)
    self._static = _Static(self.args, self.max_prompt_len, self.max_new_tokens)
    self._options = tuple(sorted((compiler_options or {}).items()))

  @property
  def knobs(self):
    return jnp.asarray([self.temperature, self.top_p, self.logit_noise], jnp.float32)

  def generate(self, variables, prompts, prompt_lens, rng) -> dict:
    """prompts int [B, P'] (P' <= max_prompt_len) left-padded with pad_id, prompt_lens int [B] -> output dict."""
    prompts, lens = jnp.asarray(prompts), jnp.asarray(prompt_lens)
    if prompts.ndim != 2 or not jnp.issubdtype(prompts.dtype, jnp.integer):
      raise ValueError(f"prompts must be an integer array [B, P], got {prompts.dtype} {prompts.shape}")
    B, Pw = prompts.shape
    if Pw > self.max_prompt_len:
      raise ValueError(f"prompts has width {Pw} > max_prompt_len={self.max_prompt_len} (shape {prompts.shape})")
    if lens.shape != (B,) or not jnp.issubdtype(lens.dtype, jnp.integer):
      raise ValueError(f"prompt_lens must be an integer array [B={B}], got {lens.dtype} {lens.shape}")
    try:
      ln = np.asarray(lens)
    except jax.errors.TracerArrayConversionError:
      ln = None
    if ln is not None and (ln.min() < 1 or ln.max() > Pw):
      raise ValueError(f"prompt_lens must lie in [1, {Pw}] (prompts shape {prompts.shape}), got {ln.tolist()}")
    prompts = jnp.pad(prompts.astype(jnp.int32), ((0, 0), (self.max_prompt_len - Pw, 0)), constant_values=self.pad_id)
    ids = jnp.asarray([self.eos_id, self.pad_id], jnp.int32)
    return _compiled(self._static, self.spec_decode, self._options)(
      variables, prompts, lens.astype(jnp.int32), self.knobs, ids, rng
    )

  # Low-level pieces (tests, benchmarks): the exact cached call generate() uses, in the engine's dtype.
  def init_cache(self, batch, length, lookahead=0, mtp=False):
    return init_cache(self.args, batch, length, lookahead, mtp=mtp)

  def model_call(self, variables, tokens, positions, segment_ids, cache, cache_index):
    """-> (logits [B, T, V] fp32, hidden [B, T, H], new cache, {MoE layer: routing confidence}, valid tokens)."""
    return _compiled_call(self.args, self._options)(variables, tokens, positions, segment_ids, cache, cache_index)
