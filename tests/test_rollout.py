"""Rollout engine: cached decoding against the training forward, padding, EOS, MTP-3 speculative decoding.

All engines use the tiny config, fp32 unless stated, batch 8, and FAST_COMPILE; compiled programs are shared through
module fixtures (sampling settings and eos/pad ids are traced inputs, so one program serves several engines).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stepflash_jax as sfj
from stepflash_jax.model.cache import init_cache
from stepflash_jax import model as M
from stepflash_jax import sampling as R
from stepflash_jax.sampling import FAST_COMPILE, RolloutEngine, sampling_logprobs

B, P, N, T_FWD = 8, 12, 40, 64  # P + N = 52 > window 32: the sliding-window ring buffers wrap
LENS = np.array([12, 5, 9, 1, 7, 3, 12, 10], np.int32)
EOS, PAD = 1, 0
CHI2_9DOF_P001 = 27.88  # scipy.stats.chi2.ppf(0.999, 9)


def engine(cfg, **kw):
  kw = {
    "max_prompt_len": P,
    "max_new_tokens": N,
    "eos_id": EOS,
    "pad_id": PAD,
    "dtype": "float32",
    "compiler_options": FAST_COMPILE,
    **kw,
  }
  return RolloutEngine(cfg, **kw)


@pytest.fixture(scope="module")
def variables(tiny_cfg):
  return sfj.init(tiny_cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def restricted(variables, tiny_cfg):
  """Main and MTP heads that put almost all mass on tokens 10..13 (logits +-8 u.h, +-8 w.h, others 0), and MTP
  eh_proj passing the previous hidden state through: drafts resemble the target without equalling it, so
  acceptance is ~40% and every accept / reject / bonus path is exercised."""
  H, V = tiny_cfg.hidden_size, tiny_cfg.vocab_size
  rs = np.random.RandomState(0)
  u, w = (x / np.linalg.norm(x) for x in rs.randn(2, H))
  W = np.zeros((H, V), np.float32)
  W[:, 10], W[:, 11], W[:, 12], W[:, 13] = 8 * u, -8 * u, 8 * w, -8 * w
  eh = np.concatenate([np.zeros((H, H)), np.eye(H)], 0).astype(np.float32)
  params = dict(variables["params"])
  params["lm_head"] = {"kernel": jnp.asarray(W)}
  for k in range(tiny_cfg.num_mtp_layers):
    params[f"mtp_{k}"] = {
      **params[f"mtp_{k}"],
      "head": {"kernel": jnp.asarray(W)},
      "eh_proj": {"kernel": jnp.asarray(eh)},
    }
  return {"params": params, "router": variables["router"]}


@pytest.fixture(scope="module")
def prompts():
  rs = np.random.RandomState(1)
  p = np.full((B, P), PAD, np.int32)
  for b, n in enumerate(LENS):
    p[b, P - n :] = rs.randint(20, 512, n)
  return p


@pytest.fixture(scope="module")
def forward_mtp(tiny_cfg):
  """Training forward (fp32, no cache) [B, T_FWD] -> (log-softmax [B, T_FWD, V], MTP logits [K, B, T_FWD, V],
  backbone hidden [B, T_FWD, H])."""

  def fn(v, t):
    out = sfj.apply(tiny_cfg, v, t, mtp=True)
    return jax.nn.log_softmax(out["logits"], -1), jnp.stack(out["mtp_logits"]), out["hidden"]

  return jax.jit(fn, compiler_options=FAST_COMPILE)


@pytest.fixture(scope="module")
def forward(forward_mtp):
  """Log-softmax [B, T_FWD, V] of the training forward on each row's unpadded prompt + response."""

  def run(v, prompts, lens, response):
    seqs = np.zeros((B, T_FWD), np.int32)
    for b in range(B):
      s = np.concatenate([prompts[b, prompts.shape[1] - lens[b] :], response[b]])[:T_FWD]
      seqs[b, : len(s)] = s
    return np.asarray(forward_mtp(v, jnp.asarray(seqs))[0])

  return run


def response_logp(lp_fwd, lens, response):
  """Forward log-prob of response[b, t] (predicted at position lens[b] - 1 + t) -> [B, N]."""
  n = response.shape[1]
  idx = lens[:, None] - 1 + np.arange(n)[None]
  rows = np.take_along_axis(lp_fwd, idx[..., None], 1)  # [B, N, V]
  return np.take_along_axis(rows, response[..., None], 2)[..., 0]


@pytest.fixture(scope="module")
def plain_out(tiny_cfg, variables, prompts):
  return jax.device_get(engine(tiny_cfg).generate(variables, prompts, LENS, jax.random.key(3)))


def _teacher_forced(eng, variables, prompts, resp, width, length=P + N + 8, chunk=1):
  """Prefill the prompts left-padded to `width`, then feed resp `chunk` tokens per call -> (log-softmax [B, N, V],
  token-weighted routing confidence of the decode calls)."""
  pads = width - LENS
  p = np.concatenate([np.full((B, width - P), PAD, np.int32), prompts], 1)
  col = np.arange(width)[None]
  seg = (col >= pads[:, None]).astype(np.int32)
  logits, _, cache, _, _, _ = eng.model_call(
    variables, p, np.maximum(col - pads[:, None], 0), seg, eng.init_cache(B, length), 0
  )
  got, conf, ntok = [jax.nn.log_softmax(logits[:, -1:])], {}, 0.0
  for i in range(1, N, chunk):
    x = resp[:, i - 1 : i - 1 + chunk]
    n = x.shape[1]
    pos = (LENS + i - 1)[:, None] + np.arange(n)[None]
    logits, _, cache, c, nt, _ = eng.model_call(variables, x, pos, np.ones((B, n), np.int32), cache, width + i - 1)
    got.append(jax.nn.log_softmax(logits))
    conf = {k: conf.get(k, 0.0) + float(v) * float(nt) for k, v in c.items()}  # per MoE layer
    ntok += float(nt)
  return np.concatenate(jax.device_get(got), 1)[:, :N], {k: x / ntok for k, x in conf.items()}


@pytest.fixture(scope="module")
def forced(tiny_cfg, variables, prompts, plain_out):
  return _teacher_forced(engine(tiny_cfg), variables, prompts, plain_out["response"], P)


def test_cached_decode_matches_full_forward(tiny_cfg, variables, prompts, plain_out, forward, forced):
  """Prefill + one-token cached steps (per-row positions, left padding, ring buffers wrapping) reproduce the
  uncached forward's logits at every position; the loop's routing confidence is the token-weighted step mean."""
  resp = plain_out["response"]
  assert plain_out["response_mask"].all()  # no EOS in this run: every row feeds N - 1 tokens
  got, conf = forced
  want = np.take_along_axis(forward(variables, prompts, LENS, resp), (LENS[:, None] - 1 + np.arange(N))[..., None], 1)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  layers = plain_out["routing_confidence_layers"]
  assert sorted(layers) == sorted(conf) and len(conf) == len(tiny_cfg.moe_layers)  # one entry per MoE layer
  for k in conf:
    np.testing.assert_allclose(layers[k], conf[k], rtol=1e-5)
  np.testing.assert_allclose(plain_out["routing_confidence"], np.mean(list(conf.values())), rtol=1e-5)
  assert 0 < plain_out["routing_confidence"] <= 1 and 0 < plain_out["routing_confidence_prompt"] <= 1


def test_cached_chunks_match_full_forward(tiny_cfg, variables, prompts, plain_out, forward):
  """Multi-token cached calls into wrapping ring buffers (a chat's next turn, a tool result): after the prefill the
  responses are fed 5 tokens per call, so a call overwrites ring entries its first queries still see (window 32,
  no lookahead); the logits still equal the uncached forward's at every position."""
  resp = plain_out["response"]
  got, _ = _teacher_forced(engine(tiny_cfg), variables, prompts, resp, P, chunk=5)
  want = np.take_along_axis(forward(variables, prompts, LENS, resp), (LENS[:, None] - 1 + np.arange(N))[..., None], 1)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_left_padding_does_not_change_a_row(tiny_cfg, variables, prompts, plain_out, forced):
  """The same rows left-padded to 20 columns instead of 12 (8 more pad columns, shifted cache columns and ring
  slots) give the same logits. (generate-level: test_spec_greedy_* compares P=16 spec with P=12 plain.)"""
  got, _ = _teacher_forced(engine(tiny_cfg), variables, prompts, plain_out["response"], 20)
  np.testing.assert_allclose(got, forced[0], atol=1e-5, rtol=0)


def test_logp_equals_training_forward_fp32_and_differs_bf16(tiny_cfg, variables, prompts, plain_out, forward):
  out = plain_out
  assert out["tokens"].shape == (B, P + N) and out["response"].shape == out["logp"].shape == (B, N)
  np.testing.assert_array_equal(out["tokens"][:, P:], out["response"])
  np.testing.assert_array_equal(out["tokens"][:, :P], prompts)
  ref = response_logp(forward(variables, prompts, LENS, out["response"]), LENS, out["response"])
  np.testing.assert_allclose(out["logp"], ref, atol=1e-4, rtol=0)
  bf = jax.device_get(engine(tiny_cfg, dtype="bfloat16").generate(variables, prompts, LENS, jax.random.key(3)))
  m = bf["response_mask"] > 0
  diff = np.abs(bf["logp"] - response_logp(forward(variables, prompts, LENS, bf["response"]), LENS, bf["response"]))[m]
  print(f"bf16 rollout vs fp32 training forward: mean |logp diff| = {diff.mean():.2e}, max = {diff.max():.2e}")
  assert 3e-4 < diff.mean() < 0.1
  assert abs(bf["routing_confidence"] - out["routing_confidence"]) < 0.02


def test_logit_noise_logp_is_of_the_sampled_distribution(tiny_cfg, variables, prompts, forward):
  """With logits + 0.7 N(0,1): logp differs from the model's, and E_q[p/q] = 1 holds only if logp = log q of the
  distribution actually sampled (sampling from p instead would give 1 + chi2(p||q) ~ 1.6)."""
  eng = engine(tiny_cfg, logit_noise=0.7)
  ratios, diffs = [], []
  for seed in range(2):
    out = jax.device_get(eng.generate(variables, prompts, LENS, jax.random.key(10 + seed)))
    m = out["response_mask"] > 0
    d = response_logp(forward(variables, prompts, LENS, out["response"]), LENS, out["response"]) - out["logp"]
    ratios.append(np.exp(d[m])), diffs.append(np.abs(d[m]))
  assert np.concatenate(diffs).mean() > 0.2
  assert abs(np.concatenate(ratios).mean() - 1) < 0.2


def test_eos_stops_row_and_truncated_flag(tiny_cfg, variables, prompts):
  greedy = jax.device_get(engine(tiny_cfg, temperature=0.0).generate(variables, prompts, LENS, jax.random.key(0)))
  assert greedy["truncated"].all() and (greedy["lengths"] == N).all()
  eos = int(greedy["response"][0, 6])  # a token row 0 emits: it must stop there
  out = jax.device_get(
    engine(tiny_cfg, temperature=0.0, eos_id=eos).generate(variables, prompts, LENS, jax.random.key(0))
  )
  for b in range(B):
    hits = np.flatnonzero(greedy["response"][b] == eos)
    L = hits[0] + 1 if len(hits) else N
    assert out["lengths"][b] == L and out["truncated"][b] == (len(hits) == 0)
    np.testing.assert_array_equal(out["response"][b, :L], greedy["response"][b, :L])
    np.testing.assert_array_equal(out["response"][b, L:], PAD)
    np.testing.assert_array_equal(out["response_mask"][b], np.arange(N) < L)
    np.testing.assert_array_equal(out["logp"][b, L:], 0.0)
  assert out["lengths"][0] <= 7 and not out["truncated"][0]


@pytest.mark.parametrize("heads", ["random", "restricted"])
def test_spec_greedy_equals_plain_greedy(tiny_cfg, variables, restricted, prompts, heads):
  """Greedy MTP-3 speculative decoding (different prompt padding, 16 columns) = greedy plain decoding, incl. EOS."""
  v = restricted if heads == "restricted" else variables
  eos = 11 if heads == "restricted" else EOS  # restricted: rows stop at different points
  plain = jax.device_get(engine(tiny_cfg, temperature=0.0, eos_id=eos).generate(v, prompts, LENS, jax.random.key(0)))
  spec = jax.device_get(
    engine(tiny_cfg, temperature=0.0, eos_id=eos, spec_decode=True, max_prompt_len=16).generate(
      v, prompts, LENS, jax.random.key(5)
    )
  )
  for k in ("response", "response_mask", "lengths", "truncated"):
    np.testing.assert_array_equal(spec[k], plain[k], err_msg=k)
  np.testing.assert_allclose(spec["logp"], plain["logp"], atol=1e-4)
  print(
    f"greedy spec ({heads} heads): accept {float(spec['accept_rate']):.2f}, "
    f"tokens/call {float(spec['tokens_per_call']):.2f}, lengths {spec['lengths'].tolist()}"
  )
  if heads == "restricted":
    assert 0.2 < spec["accept_rate"] < 0.95 and spec["tokens_per_call"] > 1.3
    assert spec["truncated"].sum() < B


def nucleus_probs(logits, temp, top_p):
  """NumPy reference of the sampling distribution: softmax(logits / temp) on the smallest set of most likely
  tokens whose mass reaches top_p (plus any token tied with the least likely one kept), renormalised."""
  z = logits / temp
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  ps = -np.sort(-p, -1)
  n_keep = (np.cumsum(ps, -1) - ps < top_p).sum(-1, keepdims=True)  # >= 1
  q = np.where(p >= np.take_along_axis(ps, n_keep - 1, -1), p, 0.0)
  return q / q.sum(-1, keepdims=True)


def test_sampling_logprobs_matches_numpy_nucleus():
  logits = np.random.RandomState(0).randn(4, 3, 50).astype(np.float32) * 2
  for temp, top_p in [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (1.0, 0.01)]:
    got = np.exp(np.asarray(sampling_logprobs(jnp.asarray(logits), temp, top_p)))
    np.testing.assert_allclose(got, nucleus_probs(logits.astype(np.float64), temp, top_p), atol=1e-6)
  assert (np.exp(np.asarray(sampling_logprobs(jnp.asarray(logits), 1.0, 0.01))) > 0).sum(-1).max() == 1
  tied = np.zeros((1, 6), np.float32)
  tied[0, 0] = 1.0  # p = [.35, .13 x 5]: top_p 0.5 keeps all ties
  np.testing.assert_allclose(
    np.exp(np.asarray(sampling_logprobs(jnp.asarray(tied), 1.0, 0.5))), nucleus_probs(tied, 1.0, 0.5), atol=1e-6
  )
  assert (nucleus_probs(tied, 1.0, 0.5) > 0).all() and (nucleus_probs(tied, 1.0, 0.3) > 0).sum() == 1


def _pit_chi2(u):
  counts = np.bincount(np.minimum((u * 10).astype(int), 9), minlength=10)
  e = len(u) / 10
  return ((counts - e) ** 2 / e).sum()


def test_spec_sampling_keeps_the_main_distribution(tiny_cfg, restricted, prompts, forward):
  """Every token after the first comes from verify/accept/residual sampling. With the exact target p_t (the fp32
  forward's sampling distribution on the sampled prefix), the randomised PIT u = F_t(x_t - 1) + U p_t(x_t) is iid
  U(0,1) iff x_t ~ p_t: chi-square over 10 bins. Negative control: the same test against a wrong p rejects."""
  temp, top_p = 1.0, 0.97
  eng = engine(tiny_cfg, spec_decode=True, temperature=temp, top_p=top_p, max_prompt_len=16)
  rs = np.random.RandomState(0)
  u, u_wrong, acc = [], [], []
  for seed in range(4):
    out = jax.device_get(eng.generate(restricted, prompts, LENS, jax.random.key(100 + seed)))
    acc.append(float(out["accept_rate"]))
    resp, m = out["response"], out["response_mask"] > 0
    lp_fwd = forward(restricted, prompts, LENS, resp)
    idx = (LENS[:, None] - 1 + np.arange(N))[..., None]
    logits = np.take_along_axis(lp_fwd, idx, 1)  # [B, N, V]
    p, p_wrong = nucleus_probs(logits, temp, top_p), nucleus_probs(logits, 1.5 * temp, 1.0)
    np.testing.assert_allclose(out["logp"][m], np.log(np.take_along_axis(p, resp[..., None], -1)[..., 0])[m], atol=1e-4)
    sel = m.copy()
    sel[:, 0] = False  # token 0 comes from the prefill
    for q, dest in ((p, u), (p_wrong, u_wrong)):
      cdf = np.cumsum(q, -1)
      px = np.take_along_axis(q, resp[..., None], -1)[..., 0]
      below = np.take_along_axis(cdf, resp[..., None], -1)[..., 0] - px
      dest.append((below + rs.rand(*px.shape) * px)[sel])
  u, u_wrong = np.concatenate(u), np.concatenate(u_wrong)
  print(
    f"spec sampling: {len(u)} tokens, accept {np.mean(acc):.2f}, chi2 {_pit_chi2(u):.1f} "
    f"(wrong target: {_pit_chi2(u_wrong):.1f})"
  )
  assert len(u) > 1000 and 0.2 < np.mean(acc) < 0.95
  assert _pit_chi2(u) < CHI2_9DOF_P001
  assert _pit_chi2(u_wrong) > 2 * CHI2_9DOF_P001


def test_bad_inputs_name_the_argument(tiny_cfg, variables, prompts):
  eng = engine(tiny_cfg)
  with pytest.raises(ValueError, match="prompts"):
    eng.generate(variables, prompts[0], LENS, jax.random.key(0))
  with pytest.raises(ValueError, match="max_prompt_len"):
    eng.generate(variables, np.zeros((B, P + 1), np.int32), LENS, jax.random.key(0))
  with pytest.raises(ValueError, match="prompt_lens"):
    eng.generate(variables, prompts, LENS[:3], jax.random.key(0))
  with pytest.raises(ValueError, match="prompt_lens"):
    eng.generate(variables, prompts, np.zeros(B, np.int32), jax.random.key(0))
  for kw, name in [
    ({"top_p": 0.0}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"dtype": "fp8"}, "dtype"),
    ({"eos_id": 10**6}, "eos_id"),
  ]:
    with pytest.raises(ValueError, match=name):
      engine(tiny_cfg, **kw)


def test_mtp_draft_chain_matches_training_mtp_forward(tiny_cfg, variables, forward_mtp):
  """Teacher-forced drafting (drafts := true tokens, n accepted drafts per row and step at random, backbone hidden
  states from the uncached forward): every MTP span entry the cached chain computes, hence every draft logit,
  equals the training forward's MTP logits at that position, across rollbacks and ring-buffer wrap-around."""
  a, K, steps = M.as_args(tiny_cfg), tiny_cfg.num_mtp_layers, 12
  v = jax.tree.map(
    lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape) if x.ndim == 1 else x, variables
  )  # non-zero norm scales: a stricter check
  rs = np.random.RandomState(2)
  X = rs.randint(3, 512, (B, T_FWD)).astype(np.int32)
  ns = rs.randint(0, K + 1, (steps, B)).astype(np.int32)
  for b in range(B):  # end between position 36 and 53 (T_FWD - 2K - 5)
    while LENS[b] - 1 + (1 + ns[:, b]).sum() > 53:
      ns[np.argmax(ns[:, b]), b] -= 1
    while LENS[b] - 1 + (1 + ns[:, b]).sum() < 36:
      ns[np.argmin(ns[:, b]), b] += 1
  _, ref, hidden = forward_mtp(v, jnp.asarray(X))  # ref [K, B, T, V]: module k at t predicts t+k+2
  pad = P - LENS
  teacher = lambda nxt: lambda k, lg: (nxt[:, k], None, lg)  # "sampling" returns the true tokens
  at = lambda x, idx: jnp.take_along_axis(x, idx, 1)

  @jax.jit
  def run(v, X, hidden, ns):
    col = jnp.arange(P)[None]
    seg = (col >= pad[:, None]).astype(jnp.int32)
    pos = jnp.maximum(col - pad[:, None], 0)
    ext = jnp.concatenate([jnp.where(seg > 0, at(X, pos), 0), at(X, jnp.asarray(LENS)[:, None])], 1)
    s = jnp.asarray(LENS - 1)
    mcache = init_cache(a, B, P + T_FWD, K + 1, mtp=True)["mtp"]
    _, _, carries, mcache, pre = R.draft_prefill(
      a, v, mcache, at(hidden, pos[..., None]), ext, pos, seg, s, teacher(at(X, s[:, None] + 2 + jnp.arange(K)))
    )

    def step(c, n):
      mcache, carries, s = c
      hid = at(hidden, (s[:, None] + 1 + jnp.arange(K + 1))[..., None])  # verify positions s+1..s+K+1
      Z = at(X, s[:, None] + 2 + jnp.arange(2 * K))
      _, _, carries, mcache, lg = R.draft_step(
        a,
        v,
        mcache,
        carries,
        hid,
        Z,
        s,
        n,
        pad,
        jnp.ones(B, bool),
        teacher(at(X, (s + 3 + n)[:, None] + jnp.arange(K))),
      )
      return (mcache, carries, s + 1 + n), (s, tuple(lg))

    _, (ss, lgs) = jax.lax.scan(step, (mcache, carries, s), ns)
    return pre, ss, lgs

  pre, ss, lgs = jax.device_get(run(v, jnp.asarray(X), hidden, jnp.asarray(ns)))
  ref = np.asarray(ref)
  got, want = [], []
  for k in range(K):
    for b in range(B):
      c = np.arange(pad[b], P)  # prefill: every real prompt column
      got.append(pre[k][b, c]), want.append(ref[k, b, c - pad[b]])
      for t in range(steps):  # valid span entries (<= s_new)
        j = np.arange(ns[t, b] + k + 1)
        p = ss[t, b] - k + 1 + j
        got.append(lgs[k][t, b, j[p >= 0]]), want.append(ref[k, b, p[p >= 0]])
  np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=1e-4, rtol=0)


def _flip_rate(tiny_cfg, variables, out, width):
  """Fraction of fed tokens (prompt + every response token but a row's last) whose expert set in the engine's
  recorded `expert_ids` differs from the training forward's own top-k over the same columns."""
  toks, mask = out["tokens"], out["response_mask"]
  pads = width - LENS
  col = np.arange(width)[None]
  pos = np.concatenate([np.maximum(col - pads[:, None], 0), LENS[:, None] + np.arange(N)[None]], 1)
  seg = np.concatenate([(col >= pads[:, None]).astype(np.int32), mask.astype(np.int32)], 1)
  _, st = sfj.apply(tiny_cfg, variables, toks, positions=pos, segment_ids=seg, stats=True)
  fed = np.concatenate([seg[:, :width], mask * np.pad(mask[:, 1:], ((0, 0), (0, 1)))], 1) > 0
  assert sorted(out["expert_ids"]) == sorted(st["expert_ids"])
  flips = [
    (np.sort(out["expert_ids"][k], -1) != np.sort(np.asarray(x), -1)).any(-1)[fed] for k, x in st["expert_ids"].items()
  ]
  return float(np.mean(flips))


def test_recorded_experts_are_the_training_pass_experts(tiny_cfg, variables, restricted, prompts, plain_out):
  """Router replay's input: the experts the engine used for every fed token (prefill and decode columns; spec:
  accepted columns only, rejected drafts overwritten) equal the fp32 training forward's choice on those columns."""
  ids = plain_out["expert_ids"]
  assert all(x.shape == (B, P + N, tiny_cfg.num_experts_per_tok) and x.dtype == np.int32 for x in ids.values())
  assert _flip_rate(tiny_cfg, variables, plain_out, P) < 0.005
  eng = engine(tiny_cfg, temperature=0.0, eos_id=11, spec_decode=True, max_prompt_len=16)
  spec = jax.device_get(eng.generate(restricted, prompts, LENS, jax.random.key(5)))
  assert spec["accept_rate"] < 0.95  # some drafts were rejected and their columns rewritten
  assert _flip_rate(tiny_cfg, restricted, spec, 16) < 0.005


def test_quantized_weights_per_output_channel():
  """int8: |W' - W| <= scale / 2 with scale = max |W| over the input axes / 127, the largest entry of each channel
  exact; fp8 e4m3: relative error <= 2^-4 for entries in the normal range; experts get one scale per expert."""
  from stepflash_jax.sampling.quantize import fake_quantize, quantize_params

  rs = np.random.RandomState(0)
  w = rs.standard_normal((3, 16, 5)).astype(np.float32)  # [E, in, out]
  scale = np.abs(w).max(1, keepdims=True) / 127
  q = np.asarray(fake_quantize(w, "int8", (1,)))
  assert np.all(np.abs(q - w) <= scale / 2 + 1e-7)
  np.testing.assert_allclose(np.abs(q).max(1), np.abs(w).max(1), rtol=1e-6)
  f8 = np.asarray(fake_quantize(w, "fp8", (1,)))
  big = np.abs(w) > np.abs(w).max(1, keepdims=True) * 2.0**-6
  assert np.all(np.abs(f8 - w)[big] <= 2.0**-4 * np.abs(w)[big]) and np.abs(f8 - w).max() > 0
  with pytest.raises(ValueError, match="quantize"):
    fake_quantize(w, "int4", (1,))
  params = {"layer_2": {"moe": {"up_proj": {"kernel": w}, "router": {"kernel": w[0]}}}, "lm_head": {"kernel": w[0]}}
  out = quantize_params(params, "int8")
  np.testing.assert_array_equal(out["layer_2"]["moe"]["up_proj"]["kernel"], q)
  np.testing.assert_array_equal(out["layer_2"]["moe"]["router"]["kernel"], w[0])  # router and heads untouched
  np.testing.assert_array_equal(out["lm_head"]["kernel"], w[0])


def test_quantized_engine_adds_mismatch(tiny_cfg, variables, prompts, forward):
  """An int8-weight bf16 engine is further from the fp32 training forward than the bf16 engine alone."""
  diffs = {}
  for quant in (None, "int8"):
    out = jax.device_get(
      engine(tiny_cfg, dtype="bfloat16", quantize=quant).generate(variables, prompts, LENS, jax.random.key(3))
    )
    ref = response_logp(forward(variables, prompts, LENS, out["response"]), LENS, out["response"])
    diffs[quant] = float(np.abs(out["logp"] - ref)[out["response_mask"] > 0].mean())
  print(f"mean |logp diff| vs fp32 training: bf16 {diffs[None]:.2e}, bf16 + int8 weights {diffs['int8']:.2e}")
  assert diffs["int8"] > 1.2 * diffs[None]  # measured 1.6x (2026-12-01)
  with pytest.raises(ValueError, match="quantize"):
    engine(tiny_cfg, quantize="int4")


def test_bf16_cache_stored_in_fp32_on_cpu_changes_no_output(tiny_cfg, variables, prompts, monkeypatch):
  """model/cache.py: on a CPU backend a bf16 engine keeps bf16 keys / values in an fp32 cache. Every output equals
  that of bf16 storage: the tokens bit for bit, log-probs and routing confidences to float rounding (attention's
  dot reads the fp32 cache directly, a bf16 cache through a conversion: XLA picks other kernels)."""
  from stepflash_jax.model import cache as cache_lib
  from stepflash_jax.sampling import engine as engine_lib

  cpu = jax.default_backend() == "cpu"
  assert cache_lib.storage_dtype(jnp.bfloat16) == (jnp.float32 if cpu else jnp.bfloat16)
  assert cache_lib.storage_dtype(jnp.float32) == jnp.float32

  def run():
    engine_lib._compiled.cache_clear()  # programs are cached by shapes: trace again under the current rule
    out = engine(tiny_cfg, dtype="bfloat16").generate(variables, prompts, LENS, jax.random.key(5))
    engine_lib._compiled.cache_clear()
    return jax.device_get(out)

  stored = run()
  monkeypatch.setattr(cache_lib, "storage_dtype", jnp.dtype)
  ref = run()
  assert jax.tree.structure(stored) == jax.tree.structure(ref)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(stored), jax.tree.leaves(ref)):
    if np.issubdtype(np.asarray(a).dtype, np.floating):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-2, err_msg=jax.tree_util.keystr(path))
    else:
      np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
