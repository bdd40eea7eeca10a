"""The compiled programs of one RL generation (docs/rl.md §1): scoring (logp_old / logp_ref, entropy, routing
confidence), values, advantages, mismatch statistics, and the actor and critic mini-batch updates.

All log-probs are taken under the rollout's sampling distribution (rl.temperature, rl.top_p: `token_logp`) in the
training engine's numerics (float32), so pi / pi_old and pi_old / pi_vllm compare one distribution.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from stepflash_jax import model as model_lib
from stepflash_jax import parallel
from stepflash_jax.model.moe import stat_layers
from stepflash_jax.model.transformer import head_logits
from stepflash_jax.model.replay import moe_layer_names
from stepflash_jax.rl import advantages as adv_lib
from stepflash_jax.rl import losses, packing
from stepflash_jax.rl.batches import minibatches
from stepflash_jax.rl.critic import response_values
from stepflash_jax.sampling import sampling_logprobs
from stepflash_jax.train.step import frozen_mask, guarded_update


def mis_args(rcfg) -> dict:
  """The MIS filter's settings from the rl config: token / trajectory bounds and the tokens rho runs over."""
  return dict(
    token_bounds=tuple(rcfg.token_bounds), traj_bounds=tuple(rcfg.traj_bounds), rho_tokens=rcfg.get("rho_tokens", "all")
  )


def objective(rcfg, logp, mb, normalizer=None):
  """The configured actor loss on a mini-batch (all [n, R] float32); rl.normalizer ("valid" | "kept") applies to
  every objective (PPO and TIS filter nothing: for them "kept" = "valid"). normalizer: a number overriding it (a
  micro-batch's share of its mini-batch: `objective_denominator`)."""
  o, norm = rcfg.objective, rcfg.normalizer if normalizer is None else normalizer
  if o == "mispo":
    return losses.mispo_loss(
      logp, mb["logp_old"], mb["logp_rollout"], mb["adv"], mb["mask"], normalizer=norm, **mis_args(rcfg)
    )
  if o == "ppo":
    return losses.ppo_loss(logp, mb["logp_old"], mb["adv"], mb["mask"], clip_eps=rcfg.ppo_clip, normalizer=norm)
  if o == "gspo":
    return losses.gspo_loss(
      logp,
      mb["logp_old"],
      mb["logp_rollout"],
      mb["adv"],
      mb["mask"],
      clip_eps=rcfg.gspo_clip,
      normalizer=norm,
      **mis_args(rcfg),
    )
  return losses.tis_loss(
    logp, mb["logp_old"], mb["logp_rollout"], mb["adv"], mb["mask"], cap=rcfg.tis_cap, normalizer=norm
  )


def objective_denominator(rcfg, mb):
  """The denominator rl.normalizer gives `objective` on the whole mini-batch mb: max(#valid, 1), or max(#kept, 1)
  for "kept" with the MIS-filtered objectives (the filter reads constants only, so it is known before the pass)."""
  if rcfg.normalizer == "kept" and rcfg.objective in ("mispo", "gspo"):
    keep, _ = losses.mis_mask(mb["logp_old"], mb["logp_rollout"], mb["mask"], **mis_args(rcfg))
    return jnp.maximum(keep.sum(), 1.0)
  return valid_denominator(mb["mask"])


def valid_denominator(mask):
  """max(#valid tokens, 1): the "valid" normalizer of every loss (losses.py), as a number for micro-batches."""
  return jnp.maximum((mask != 0).sum().astype(jnp.float32), 1.0)


def split_rows(tree, micro: int):
  """Every leaf [n, ...] -> [n / micro, micro, ...]: the micro-batches of a (mini-)batch (rl.micro_batch rows)."""
  n = tree["mask"].shape[0]
  if micro == n:  # one micro-batch (a packed batch always: its packed leaves have their own row count)
    return jax.tree.map(lambda x: x[None], tree)
  if packing.packed(tree):
    raise ValueError("a packed batch (rl.pack) runs as one micro-batch: rl.micro_batch must be 0")
  if n % micro:
    raise ValueError(f"rl.micro_batch={micro} does not divide a batch of {n} rows")
  return jax.tree.map(lambda x: x.reshape(n // micro, micro, *x.shape[1:]), tree)


def merge_rows(tree):
  """Inverse of `split_rows`: [k, micro, ...] -> [k * micro, ...]."""
  return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree)


def weighted_mean(values, weights):
  """{name: [k]} per-micro-batch means, [k] token counts -> {name: the token-weighted mean over the batch}."""
  w = weights / jnp.maximum(weights.sum(), 1.0)
  return {k: (v * w).sum() for k, v in values.items()}


def accumulate(loss_fn, params, mb, micro: int):
  """Sum over the micro-batches of mb of loss_fn(params, micro-batch) -> (loss, aux) and of its gradient, one
  micro-batch's activations alive at a time (lax.scan). Returns (summed loss, summed grads, aux stacked [k, ...])."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def body(acc, m):
    (loss, aux), g = grad_fn(params, m)
    return (acc[0] + loss, jax.tree.map(jnp.add, acc[1], g)), aux

  zeros = (jnp.float32(0), jax.tree.map(jnp.zeros_like, params))
  (loss, grads), aux = jax.lax.scan(body, zeros, split_rows(mb, micro))
  return loss, grads, aux


def mismatch_stats(rcfg, mb) -> dict:
  """Train/inference mismatch of a mini-batch, logged for every objective (PPO and TIS ignore pi_vllm; for them the
  MIS fractions say what MIS-PO would keep): |log pi_old - log pi_vllm| mean / max over valid tokens, mean
  |log rho| over non-empty responses (rho: the geometric mean of x_t), mean |sum_t log x_t| (the log of the whole
  response's ratio prod_t x_t: at equal per-token mismatch it grows with the length, the geometric mean does not),
  MIS token / trajectory / joint keep fractions. All constants of the update."""
  keep, info = losses.mis_mask(mb["logp_old"], mb["logp_rollout"], mb["mask"], **mis_args(rcfg))
  n, n_seq = jnp.maximum(info["valid"].sum(), 1), jnp.maximum(info["nonempty"].sum(), 1)
  ad = jnp.abs(info["log_x"])
  return {
    "logp_abs_diff_mean": ad.sum() / n,
    "logp_abs_diff_max": ad.max(),
    "log_rho_abs_mean": jnp.abs(info["log_rho"]).sum() / n_seq,
    "log_seq_ratio_abs_mean": jnp.abs(info["log_x"].sum(-1)).sum() / n_seq,
    "mis_token_keep_frac": info["token_ok"].sum() / n,
    "mis_traj_keep_frac": info["traj_ok"].sum() / n_seq,
    "mis_kept_frac": keep.sum() / n,
  }


def experts_dict(args, mb):
  """The rollout's experts mb["rollout_experts"] [n, layers, T, k] (`batches.sequences`) -> apply's replay_experts
  {layer: [n, T, k]}."""
  if "rollout_experts" not in mb:
    raise ValueError("router replay needs the rollout engine's experts: batch field 'rollout_experts' is missing")
  names = sorted(moe_layer_names(args))
  if mb["rollout_experts"].shape[1] != len(names):
    raise ValueError(f"rollout_experts has {mb['rollout_experts'].shape[1]} MoE layers, the model {len(names)}")
  return {name: mb["rollout_experts"][:, i] for i, name in enumerate(names)}


def response_heads(args, variables, mb, prompt_len, replay=False):
  """The training engine's main head on the response: ((normed hidden [n, R, H] at the positions predicting each
  response token, head weight [H, V]), MoE stats); no logits (`model.head_logprobs`). replay: the MoE layers use
  the rollout's experts mb["rollout_experts"] (router replay, model/replay.py)."""
  tokens, positions, segment_ids = packing.inputs(mb)
  replay_experts = None
  if replay:
    replay_experts = experts_dict(args, mb)
    if packing.packed(mb):
      replay_experts = {k: packing.pack(v, mb) for k, v in replay_experts.items()}
  out, st = model_lib.apply(
    args,
    variables,
    tokens,
    positions=positions,
    segment_ids=segment_ids,
    stats=True,
    replay_experts=replay_experts,
    logits=False,
  )
  R = mb["tokens"].shape[1] - prompt_len
  hn, w = out["heads"][0]
  if packing.packed(mb):
    hn, st = packing.unpack(hn, mb), packing.unpack_stats(st, mb)
  return (hn[:, prompt_len - 1 : prompt_len - 1 + R], w), st


def response_logp(head, response, temperature=1.0, top_p=1.0, entropy=True):
  """(logp [n, R] of each response token under the rollout's sampling distribution (`token_logp`), entropy [n, R]
  of the model's own distribution (temperature 1, no nucleus), or None if not `entropy`), both float32. top_p = 1
  (the recipe): vocabulary-chunked, no [n, R, V] logits; a nucleus needs the sorted logits of the micro-batch."""
  if top_p < 1.0:
    logits = head_logits(*head)
    ent = losses.entropy_from_logits(logits, jnp.ones(logits.shape[:2]), per_token=True)[1] if entropy else None
    return token_logp(logits, response, temperature, top_p), ent
  logp, _, ent = model_lib.head_logprobs(head, response, temperature)
  if entropy and temperature != 1.0:
    ent = model_lib.head_logprobs(head, response)[2]
  return logp, ent if entropy else None


def flip_rates(args, stats, mb, prompt_len) -> dict:
  """{MoE layer: expert-flip rate}: the fraction of fed response tokens (`fed_mask`) whose set of chosen experts in
  this training pass differs from the rollout engine's (mb["rollout_experts"]; none recorded: {})."""
  if "rollout_experts" not in mb:
    return {}
  fed = fed_mask(mb["mask"])
  n, R = jnp.maximum(fed.sum(), 1.0), fed.shape[1]
  rollout = experts_dict(args, mb)
  out = {}
  for name, ids in stats["expert_ids"].items():
    if name in rollout:
      a, b = (jnp.sort(x[:, prompt_len : prompt_len + R], -1) for x in (ids, rollout[name]))
      out[name] = ((a != b).any(-1) * fed).sum() / n
  return out


def token_logp(logits, tokens, temperature=1.0, top_p=1.0):
  """log-prob [n, R] of each sampled token under the rollout's sampling distribution: softmax(logits / temperature)
  restricted to the top-p nucleus, renormalised (`sampling_logprobs`, what the rollout engine records). logp_old,
  logp_ref and the actor's logp all use it, so pi/pi_old and pi_old/pi_vllm compare one distribution and the MIS
  filters see engine mismatch only. A token outside this engine's nucleus (the rollout's nucleus, other numerics,
  kept it; or the actor moved it out) is scored as if the nucleus were widened to include it, log p(a) - log(M +
  p(a)) with M the nucleus mass: finite (far from pi_vllm, so MIS filters it) where -inf would make the loss
  non-finite. temperature 1, top_p 1: plain log-softmax."""
  tok = lambda lp: jnp.take_along_axis(lp, tokens[..., None], -1)[..., 0]
  lp_t = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, -1)
  if top_p >= 1.0:
    return tok(lp_t)
  lp_s = sampling_logprobs(logits, temperature, top_p)
  a_t, a_s = tok(lp_t), tok(lp_s)
  log_mass = jnp.max(lp_t, -1) - jnp.max(lp_s, -1)  # log nucleus mass (the most likely token is always inside)
  return jnp.where(jnp.isfinite(a_s), a_s, a_t - jnp.logaddexp(log_mass, a_t))


def fed_mask(mask):
  """Response tokens the rollout engine fed back through the model [n, R]: every valid token but a row's last
  (that one is sampled, never fed). Its routing confidence is what `routing_confidence` of the rollout averages."""
  return mask * jnp.pad(mask[:, 1:], ((0, 0), (0, 1)))


def response_confidence(stats, mask, prompt_len):
  """{MoE layer: Sigma_k} of a training-engine pass averaged over the same response tokens as the rollout's
  (`fed_mask`), token-weighted over the batch; prompt tokens are left out as in the rollout's decode average."""
  fed = fed_mask(mask)
  R, n = fed.shape[1], jnp.maximum(fed.sum(), 1.0)

  def reduce(path, x):
    if "confidence_per_token" not in [str(getattr(k, "key", "")) for k in path]:
      return x
    return (x[..., prompt_len : prompt_len + R] * fed).sum((-2, -1)) / n  # [B, T] or [blocks, B, T]

  return stat_layers(jax.tree_util.tree_map_with_path(reduce, stats), "confidence_per_token")


def kl_coef_at(rcfg, step: int) -> float:
  """The KL coefficient for the updates of generation `step` (0-based): rl.kl_coef from rl.kl_start on, else 0."""
  return float(rcfg.kl_coef) if step >= rcfg.get("kl_start", 0) else 0.0


def generation_advantages(rcfg, values, mask, task_reward, truncated):
  """values [n, R + 1], mask [n, R], task_reward / truncated [n] -> (advantages, returns) [n, R]: terminal rewards
  (rl.truncation: V(s_T) for truncated responses under "bootstrap"), then GAE with rl.gamma / rl.lam."""
  final = adv_lib.value_after_last(values, mask)
  term = adv_lib.terminal_rewards(task_reward, truncated, final, mode=rcfg.truncation)
  r = adv_lib.place_terminal_reward(term, mask)
  return adv_lib.gae_advantages(r, values, mask, rcfg.gamma, rcfg.lam)


class Programs:
  """The jitted pieces of a generation, compiled once per (model, config); `score` and `actor_step` take a static
  `replay` flag (router replay on / off: two programs). Every pass over the model runs in micro-batches of
  rl.micro_batch rows (0, or a batch no larger: the whole batch at once): scoring maps over them, an update sums
  their gradients before its one optimizer step, so memory depends on the micro-batch, not on the generation
  (docs/rl.md §1, step 6)."""

  def __init__(self, args, rcfg, actor_tx, critic_tx, prompt_len, freeze_mask):
    P, self.rcfg = prompt_len, rcfg
    sampling = dict(temperature=rcfg.get("temperature", 1.0), top_p=rcfg.get("top_p", 1.0))
    micro = lambda mb: min(rcfg.get("micro_batch", 0) or mb["mask"].shape[0], mb["mask"].shape[0])

    def score(params, router, mb, replay=False):
      """-> logp [n, R], entropy, {layer: Sigma_k}, {layer: expert-flip rate against the rollout}."""

      def one(m):
        head, st = response_heads(args, {"params": params, "router": router}, m, P, replay)
        logp, ent = response_logp(head, m["response"], **sampling)
        fed = fed_mask(m["mask"]).sum()
        return logp, (ent * m["mask"]).sum(), response_confidence(st, m["mask"], P), flip_rates(args, st, m, P), fed

      logp, ent, conf, flips, fed = jax.lax.map(one, split_rows(mb, micro(mb)))
      n_valid = jnp.maximum(mb["mask"].sum(), 1.0)
      return merge_rows(logp), ent.sum() / n_valid, weighted_mean(conf, fed), weighted_mean(flips, fed)

    self._jit = {"score": jax.jit(score, static_argnames="replay")}

    def critic_values(cp, router, m):
      """V(s_t) [n, R + 1] of a (micro-)batch."""
      variables = {"params": cp, "router": router}
      return response_values(args, variables, m, P)

    def values(cp, router, mb):
      return merge_rows(jax.lax.map(lambda m: critic_values(cp, router, m), split_rows(mb, micro(mb))))

    self._jit["values"] = jax.jit(values)

    def actor_step(state, mb, kl_coef=None, replay=False):
      """kl_coef: a float32 scalar (the run passes `kl_coef_at(rcfg, step)`); None = rl.kl_coef. replay: router
      replay of the rollout's experts. Each micro-batch's loss is divided by the whole mini-batch's denominator,
      so the summed gradient is that of the mini-batch's loss; metrics from the concatenated log-probs."""
      kl_coef = jnp.asarray(rcfg.kl_coef if kl_coef is None else kl_coef, jnp.float32)
      obj_den, kl_den = objective_denominator(rcfg, mb), valid_denominator(mb["mask"])

      def loss_fn(params, m):
        head, st = response_heads(args, {"params": params, "router": state["router"]}, m, P, replay)
        logp, _ = response_logp(head, m["response"], **sampling, entropy=False)
        loss, _ = objective(rcfg, logp, m, obj_den)
        if rcfg.kl_coef > 0:  # kl_coef: rl.kl_coef, or 0 before rl.kl_start (the KL is logged either way)
          loss = loss + kl_coef * losses.unbiased_kl(logp, m["logp_old"], m["logp_ref"], m["mask"], kl_den)
        return loss, (logp, response_confidence(st, m["mask"], P), fed_mask(m["mask"]).sum())

      _, g, (logp, conf, fed) = accumulate(loss_fn, state["params"], mb, micro(mb))
      logp = merge_rows(logp)
      loss, m = objective(rcfg, logp, mb)
      if rcfg.kl_coef > 0:
        kl = losses.unbiased_kl(logp, mb["logp_old"], mb["logp_ref"], mb["mask"])
        loss = loss + kl_coef * kl
        m = {**m, "kl": kl, "kl_coef": kl_coef}
      conf = weighted_mean(conf, fed)
      m["confidence_train"] = jnp.stack(list(conf.values())).mean() if conf else jnp.float32(jnp.nan)
      params, opt, gnorm, skipped = guarded_update(state, g, loss, actor_tx, freeze_mask)
      m = {**m, "actor_loss": loss, "actor_grad_norm": gnorm, "skipped": skipped}
      return {**state, "params": params, "opt": opt}, m

    self._jit["actor_step"] = jax.jit(actor_step, static_argnames="replay")

    def critic_step(state, mb):
      den = valid_denominator(mb["mask"])

      def loss_fn(cp, m):
        v = critic_values(cp, state["router"], m)
        return losses.value_loss(v[:, :-1], m["returns"], m["mask"], normalizer=den)[0], None

      loss, g, _ = accumulate(loss_fn, state["params"], mb, micro(mb))
      # the critic's router follows the actor's freeze switch (rl.freeze_router)
      params, opt, gnorm, skipped = guarded_update(
        state, g, loss, critic_tx, frozen_mask(state["params"], rcfg.get("freeze_router", True))
      )
      m = {"critic_loss": loss, "critic_grad_norm": gnorm, "skipped": skipped}
      return {**state, "params": params, "opt": opt}, m

    self._jit["critic_step"] = jax.jit(critic_step)
    self._exe = {}  # (name, replay) -> compiled executable (`compile`)

    self.advantages = jax.jit(functools.partial(generation_advantages, rcfg))
    self.mismatch = jax.jit(lambda mb: mismatch_stats(rcfg, mb))

  def _call(self, name, replay, *xs):
    exe = self._exe.get((name, replay, any(packing.packed(x) for x in xs if isinstance(x, dict))))
    if exe is not None:
      return exe(*xs)
    return self._jit[name](*xs) if replay is None else self._jit[name](*xs, replay=replay)

  def score(self, params, router, mb, replay=False):
    return self._call("score", replay, params, router, mb)

  def values(self, params, router, mb):
    return self._call("values", None, params, router, mb)

  def actor_step(self, state, mb, kl_coef=None, replay=False):
    return self._call("actor_step", replay, state, mb, kl_coef)

  def critic_step(self, state, mb):
    return self._call("critic_step", None, state, mb)

  def lower(self, name, *xs, replay=None):
    """Program `name` ("score", "values", "actor_step", "critic_step") lowered on xs (arrays or ShapeDtypeStructs);
    replay: the static flag of "score" / "actor_step". `.compile()` it (its memory_analysis(): rl_memory.py)."""
    return self._jit[name].lower(*xs, **({} if replay is None else {"replay": replay}))

  def compile(self, state, batch, minibatch_counts, mesh, rules, replay=(False,)):
    """Compile the generation's big programs concurrently, one per thread (tracing, lowering and parts of XLA's
    compilation are single-threaded: measured on 2 cores, 95 s instead of ~113 s one after the other); later calls
    use the executables. `batch` is a generation as `sequences` returns it (only its shapes are used); `replay`:
    the router-replay flags the run will use (the scoring pass without replay always runs: flip rates)."""
    n, R = batch["mask"].shape
    full = {**batch, **{k: np.zeros((n, R), np.float32) for k in ("logp_old", "logp_ref", "adv", "returns")}}
    pack = self.rcfg.get("pack", 0.0)
    jb = parallel.shard_batch(packing.add(batch, pack), mesh, rules, global_batch=True)
    amb, cmb = (next(minibatches(full, m, np.random.default_rng(0), mesh, rules, pack)) for m in minibatch_counts)
    a, c = state["actor"], state["critic"]
    jobs = {("values", None): (c["params"], c["router"], jb), ("critic_step", None): (c, cmb)}
    for flag in sorted(set(replay) | {False}):
      jobs[("score", flag)] = (a["params"], a["router"], jb)
    for flag in replay:
      jobs[("actor_step", flag)] = (a, amb, jnp.float32(0))

    lower = lambda key: self.lower(key[0], *jobs[key], replay=key[1]).compile()

    done = parallel.concurrently(**{f"{k[0]}/{k[1]}": lambda k=k: lower(k) for k in jobs})
    packed = lambda k: any(packing.packed(x) for x in jobs[k] if isinstance(x, dict))
    self._exe.update({(*k, packed(k)): done[f"{k[0]}/{k[1]}"] for k in jobs})
