"""RL with a critic (docs/rl.md §1): SFT -> [rollout -> rewards -> values -> advantages -> mini-batch updates]*.

One generation:
  1. the rollout engine (its own numerics, bf16 by default) samples `samples_per_prompt` responses per prompt and
     records logp_rollout = log pi_vllm(a_t | s_t);
  2. rule rewards; truncated responses get V(s_T) (truncation-aware bootstrapping) or 0 / the task reward;
  3. the training engine (fp32) recomputes logp_old with the pre-update actor, logp_ref with the frozen SFT
     params (unbiased KL) and V(s_t) with the critic; GAE (gamma = lambda = 1: A_t = R - V(s_t)); all log-probs
     under the rollout's sampling distribution (rl.temperature, rl.top_p: `token_logp`);
  4. one epoch: `actor_minibatches` actor updates with the configured objective (MIS-PO / PPO / GSPO / TIS)
     + kl_coef * unbiased KL (from generation rl.kl_start on), and `critic_minibatches` critic updates (value
     loss), each a jitted step (Muon).
Everything per generation is logged (reward, accuracy, grad norms, keep fractions, entropy, KL, truncation, routing
confidence on the rollout and on the training pass, mean and per MoE layer, throughput); held-out greedy accuracy at
intervals.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from stepflash_jax import model as model_lib
from stepflash_jax import parallel
from stepflash_jax.train import state as state_lib
from stepflash_jax.data import prompt_dataset
from stepflash_jax.model.moe import stat_layers
from stepflash_jax.rl import advantages as adv_lib
from stepflash_jax.rl import losses
from stepflash_jax.rl.critic import critic_from_actor, response_values
from stepflash_jax.rl.rewards import score_batch
from stepflash_jax.sampling import RolloutEngine, sampling_logprobs
from stepflash_jax.train import evaluate, sft
from stepflash_jax.train.checkpoint import Checkpointer
from stepflash_jax.train.step import due, frozen_mask, guarded_update, make_optimizer, warmup_constant
from stepflash_jax.train.metrics import MetricsWriter, Progress, StageClock, plot_metrics, read_jsonl, summary_table


def objective(rcfg, logp, mb):
  """The configured actor loss on a mini-batch (all [n, R] float32); rl.normalizer ("valid" | "kept") applies to
  every objective (PPO and TIS filter nothing: for them "kept" = "valid")."""
  o, norm = rcfg.objective, rcfg.normalizer
  if o == "mispo":
    return losses.mispo_loss(
      logp,
      mb["logp_old"],
      mb["logp_rollout"],
      mb["adv"],
      mb["mask"],
      tuple(rcfg.token_bounds),
      tuple(rcfg.traj_bounds),
      normalizer=norm,
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
      token_bounds=tuple(rcfg.token_bounds),
      traj_bounds=tuple(rcfg.traj_bounds),
      normalizer=norm,
    )
  return losses.tis_loss(
    logp, mb["logp_old"], mb["logp_rollout"], mb["adv"], mb["mask"], cap=rcfg.tis_cap, normalizer=norm
  )


def mismatch_stats(rcfg, mb) -> dict:
  """Train/inference mismatch of a mini-batch, logged for every objective (PPO and TIS ignore pi_vllm; for them the
  MIS fractions say what MIS-PO would keep): |log pi_old - log pi_vllm| mean / max over valid tokens, mean
  |log rho| over non-empty responses, MIS token / trajectory / joint keep fractions. All constants of the update."""
  keep, info = losses.mis_mask(
    mb["logp_old"], mb["logp_rollout"], mb["mask"], tuple(rcfg.token_bounds), tuple(rcfg.traj_bounds)
  )
  n, n_seq = jnp.maximum(info["valid"].sum(), 1), jnp.maximum(info["nonempty"].sum(), 1)
  ad = jnp.abs(info["log_x"])
  return {
    "logp_abs_diff_mean": ad.sum() / n,
    "logp_abs_diff_max": ad.max(),
    "log_rho_abs_mean": jnp.abs(info["log_rho"]).sum() / n_seq,
    "mis_token_keep_frac": info["token_ok"].sum() / n,
    "mis_traj_keep_frac": info["traj_ok"].sum() / n_seq,
    "mis_kept_frac": keep.sum() / n,
  }


def response_logits(args, variables, mb, prompt_len, stats=False):
  """Training-engine logits predicting each response token: [n, R, V] (fp32), and the MoE stats."""
  out, st = model_lib.apply(
    args, variables, mb["tokens"], positions=mb["positions"], segment_ids=mb["segment_ids"], stats=True
  )
  R = mb["tokens"].shape[1] - prompt_len
  return out["logits"][:, prompt_len - 1 : prompt_len - 1 + R], st


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


class Functions:
  """The jitted pieces of a generation, compiled once per (model, config)."""

  def __init__(self, args, rcfg, actor_tx, critic_tx, prompt_len, freeze_mask):
    P = prompt_len
    sampling = dict(temperature=rcfg.get("temperature", 1.0), top_p=rcfg.get("top_p", 1.0))

    def score(params, router, mb):
      logits, st = response_logits(args, {"params": params, "router": router}, mb, P)
      mask = mb["mask"]
      return (
        token_logp(logits, mb["response"], **sampling),
        losses.entropy_from_logits(logits, mask),  # of the model's distribution (temperature 1, no nucleus)
        response_confidence(st, mask, P),
      )

    self.score = jax.jit(score)
    self.values = jax.jit(
      lambda cp, router, mb: response_values(
        args, {"params": cp, "router": router}, mb["tokens"], mb["positions"], mb["segment_ids"], P
      )
    )

    def actor_loss(params, router, mb, kl_coef):
      logits, st = response_logits(args, {"params": params, "router": router}, mb, P)
      logp = token_logp(logits, mb["response"], **sampling)
      loss, m = objective(rcfg, logp, mb)
      if rcfg.kl_coef > 0:  # kl_coef: rl.kl_coef, or 0 before rl.kl_start (the KL is logged either way)
        kl = losses.unbiased_kl(logp, mb["logp_old"], mb["logp_ref"], mb["mask"])
        loss = loss + kl_coef * kl
        m = {**m, "kl": kl, "kl_coef": kl_coef}
      conf = response_confidence(st, mb["mask"], P)
      conf = jnp.stack(list(conf.values())).mean() if conf else jnp.float32(jnp.nan)
      return loss, {**mismatch_stats(rcfg, mb), **m, "confidence_train": conf}

    def actor_step(state, mb, kl_coef=None):
      """kl_coef: a float32 scalar (the run passes `kl_coef_at(rcfg, step)`); None = rl.kl_coef."""
      kl_coef = jnp.asarray(rcfg.kl_coef if kl_coef is None else kl_coef, jnp.float32)
      (loss, m), g = jax.value_and_grad(actor_loss, has_aux=True)(state["params"], state["router"], mb, kl_coef)
      params, opt, gnorm, skipped = guarded_update(state, g, loss, actor_tx, freeze_mask)
      return {**state, "params": params, "opt": opt}, {
        **m,
        "actor_loss": loss,
        "actor_grad_norm": gnorm,
        "skipped": skipped,
      }

    self.actor_step = jax.jit(actor_step)

    def critic_loss(cp, router, mb):
      v = response_values(args, {"params": cp, "router": router}, mb["tokens"], mb["positions"], mb["segment_ids"], P)
      return losses.value_loss(v[:, :-1], mb["returns"], mb["mask"])

    def critic_step(state, mb):
      (loss, _), g = jax.value_and_grad(critic_loss, has_aux=True)(state["params"], state["router"], mb)
      # the critic's router follows the actor's freeze switch (rl.freeze_router)
      params, opt, gnorm, skipped = guarded_update(
        state, g, loss, critic_tx, frozen_mask(state["params"], rcfg.get("freeze_router", True))
      )
      return {**state, "params": params, "opt": opt}, {
        "critic_loss": loss,
        "critic_grad_norm": gnorm,
        "skipped": skipped,
      }

    self.critic_step = jax.jit(critic_step)

    def advantages(values, mask, task_reward, truncated):
      final = adv_lib.value_after_last(values, mask)
      term = adv_lib.terminal_rewards(task_reward, truncated, final, mode=rcfg.truncation)
      r = adv_lib.place_terminal_reward(term, mask)
      return adv_lib.gae_advantages(r, values, mask, rcfg.gamma, rcfg.lam)

    self.advantages = jax.jit(advantages)

  def compile(self, state, batch, minibatch_counts, mesh, rules):
    """Compile the generation's four big programs concurrently, one per thread, then call the compiled executables
    (tracing, lowering and parts of XLA's compilation are single-threaded: measured on 2 cores, 95 s instead of
    ~113 s one after the other). `batch` is a generation as `sequences` returns it; only its shapes are used."""
    n, R = batch["mask"].shape
    full = {**batch, **{k: np.zeros((n, R), np.float32) for k in ("logp_old", "logp_ref", "adv", "returns")}}
    jb = parallel.shard_batch(batch, mesh, rules, global_batch=True)
    amb, cmb = (next(minibatches(full, m, np.random.default_rng(0), mesh, rules)) for m in minibatch_counts)
    a, c = state["actor"], state["critic"]
    jobs = {
      "score": (a["params"], a["router"], jb),
      "values": (c["params"], c["router"], jb),
      "actor_step": (a, amb, jnp.float32(0)),
      "critic_step": (c, cmb),
    }
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
      done = {k: pool.submit(lambda k=k: getattr(self, k).lower(*jobs[k]).compile()) for k in jobs}
      for k, fut in done.items():
        setattr(self, k, fut.result())


def sequences(prompts, gen):
  """Prompt batch + engine output -> full sequences with positions and segment ids for the training engine."""
  R = gen["response"].shape[1]
  mask = np.asarray(gen["response_mask"], np.float32)
  pos_r = prompts["lengths"][:, None] + np.arange(R)[None]
  return {
    "tokens": np.concatenate([prompts["tokens"], np.asarray(gen["response"])], 1).astype(np.int32),
    "positions": np.concatenate([prompts["positions"], pos_r], 1).astype(np.int32),
    "segment_ids": np.concatenate([prompts["segment_ids"], mask.astype(np.int32)], 1),
    "response": np.asarray(gen["response"], np.int32),
    "mask": mask,
    "logp_rollout": np.asarray(gen["logp"], np.float32),
  }


def repeat_prompts(batch, n):
  out = {k: np.repeat(v, n, axis=0) for k, v in batch.items() if k != "examples"}
  out["examples"] = [ex for ex in batch["examples"] for _ in range(n)]
  return out


def minibatches(batch, n, rng, mesh, rules):
  perm = rng.permutation(len(batch["mask"]))
  for idx in np.array_split(perm, n):
    yield parallel.shard_batch({k: v[idx] for k, v in batch.items()}, mesh, rules, global_batch=True)


def run(config, workdir: str, log=print):
  """The main job: SFT (or reuse its checkpoint) -> held-out eval -> RL -> eval, summary, plots."""
  mesh, rules = parallel.make_mesh(config.mesh), parallel.rules(config)
  with parallel.use_mesh(mesh, rules):
    return _run(config, workdir, log, mesh, rules)


def _run(config, workdir, log, mesh, rules):
  rc = config.rl
  # The SFT stage: trained here on the first run, resumed/reused afterwards; rl.sft_workdir points several RL runs
  # (e.g. the mismatch lab's variants) at one shared SFT run.
  sft_out = sft.train(config, rc.get("sft_workdir") or os.path.join(workdir, "sft"), log=log)
  tok: object = sft_out["tokenizer"]
  ref = sft_out["variables"]
  args = model_lib.as_args(config.model)
  P, R = config.data.max_prompt_len, rc.max_new_tokens
  eval_set = evaluate.heldout_examples(config)
  acc0 = sft_out["accuracy"]
  log(f"rl: SFT held-out accuracy {acc0['accuracy']:.3f}")

  actor_tx = make_optimizer(config.optim, warmup_constant(rc.actor_lr, rc.actor_warmup))
  critic_tx = make_optimizer(config.optim, warmup_constant(rc.critic_lr, rc.critic_warmup))
  critic_vars = state_lib.place_state(critic_from_actor(ref), args, mesh, rules)
  state = {
    "actor": {
      "params": ref["params"],
      "router": ref["router"],
      "opt": state_lib.init_opt_state(actor_tx, ref["params"], args, mesh, rules),
    },
    "critic": {
      "params": critic_vars["params"],
      "router": critic_vars["router"],
      "opt": state_lib.init_opt_state(critic_tx, critic_vars["params"], args, mesh, rules),
    },
    "step": jnp.int32(0),
  }
  data = iter(
    prompt_dataset(
      tok, batch_size=rc.prompts_per_step, max_prompt_len=P, mixture=config.data.mixture, seed=config.seed + 1
    )
  )
  rl_dir = os.path.join(workdir, "rl")
  ckpt = Checkpointer(os.path.join(rl_dir, "checkpoints"), max_to_keep=config.train.keep_checkpoints)
  start = ckpt.latest_step() or 0
  if start:
    state, extra = ckpt.restore(start, target=state)
    data.set_state(extra["data"])
    log(f"rl: resumed from generation {start} in {rl_dir}")
  writer = MetricsWriter(rl_dir, "rl", resume_step=start if start else -1)  # a fresh start drops a stale log
  if not start:  # generation 0 = the SFT policy: the curves' first point
    writer.write(0, {f"eval/{k}": v for k, v in acc0.items()})
  fns = Functions(args, rc, actor_tx, critic_tx, P, frozen_mask(ref["params"], rc.freeze_router))
  engine = RolloutEngine(
    config.model,
    max_prompt_len=P,
    max_new_tokens=R,
    eos_id=tok.eos_id,
    pad_id=tok.pad_id,
    dtype=rc.rollout_dtype,
    temperature=rc.temperature,
    top_p=rc.top_p,
    logit_noise=rc.logit_noise,
  )
  stale = collections.deque(maxlen=rc.staleness + 1)  # rollout policy = actor of `staleness` steps ago
  prog = Progress(
    rc.steps,
    every=rc.log_every,
    desc=f"rl/{rc.objective}",
    start_step=start,
    keys=["reward", "accuracy", "actor_grad_norm", "critic_loss", "kept_frac", "confidence_rollout"],
  )
  acc = acc0
  for step in range(start, rc.steps):
    t0 = time.time()
    clock = StageClock()
    rng = np.random.default_rng([config.seed, step])
    actor = state["actor"]
    stale.append({"params": actor["params"], "router": actor["router"]})
    prompts = repeat_prompts(next(data), rc.samples_per_prompt)
    pb = parallel.shard_batch(
      {"tokens": prompts["tokens"], "lengths": prompts["lengths"]}, mesh, rules, global_batch=True
    )
    gen = parallel.to_host(engine.generate(stale[0], pb["tokens"], pb["lengths"], jax.random.key(rng.integers(2**31))))
    clock.stop("rollout")
    batch = sequences(prompts, gen)
    if step == start:
      fns.compile(state, batch, (rc.actor_minibatches, rc.critic_minibatches), mesh, rules)
      clock.stop("compile")
    texts = [tok.decode(r, stop_at_eos=True) for r in batch["response"]]
    scored = score_batch(rc.reward, prompts["examples"], texts, np.asarray(gen["truncated"]))
    clock.stop("reward")
    jb = parallel.shard_batch(batch, mesh, rules, global_batch=True)
    logp_old, entropy, conf_score = fns.score(actor["params"], actor["router"], jb)
    logp_ref = fns.score(ref["params"], ref["router"], jb)[0] if rc.kl_coef > 0 else logp_old
    values = fns.values(state["critic"]["params"], state["critic"]["router"], jb)
    adv, ret = fns.advantages(values, jb["mask"], jnp.asarray(scored["reward"]), jnp.asarray(scored["truncated"]))
    logp_old, logp_ref, adv, ret, values = parallel.to_host((logp_old, logp_ref, adv, ret, values))
    batch.update(
      logp_old=np.asarray(logp_old), logp_ref=np.asarray(logp_ref), adv=np.asarray(adv), returns=np.asarray(ret)
    )
    clock.stop("score")
    am, cm = [], []
    for mb in minibatches(batch, rc.actor_minibatches, rng, mesh, rules):
      state["actor"], m = fns.actor_step(state["actor"], mb, jnp.float32(kl_coef_at(rc, step)))
      am.append(m)
    clock.stop("actor", am)
    for mb in minibatches(batch, rc.critic_minibatches, rng, mesh, rules):
      state["critic"], m = fns.critic_step(state["critic"], mb)
      cm.append(m)
    clock.stop("critic", cm)
    state["step"] = state["step"] + 1
    am, cm = parallel.to_host(am), parallel.to_host(cm)
    gn = np.array([m["actor_grad_norm"] for m in am])
    n_tok = float(batch["mask"].sum())
    metrics = {k: float(np.mean([m[k] for m in am])) for k in am[0] if k not in ("skipped",)}
    metrics.update({k: float(np.mean([m[k] for m in cm])) for k in ("critic_loss", "critic_grad_norm")})
    metrics.update(
      reward=float(scored["reward"].mean()),
      accuracy=float(scored["correct"].mean()),
      truncation_rate=float(scored["truncated"].mean()),
      actor_grad_norm_max=float(gn.max()),
      entropy=float(entropy),
      confidence_rollout=float(gen["routing_confidence"]),
      confidence_score=float(np.mean(list(conf_score.values()))) if conf_score else float("nan"),
      response_tokens=n_tok / len(batch["mask"]),
      value_mean=float(values.mean()),
      advantage_mean=float(adv.sum() / max(n_tok, 1)),
      skipped=float(sum(m["skipped"] for m in am) + sum(m["skipped"] for m in cm)),
      tokens_per_s=n_tok / (time.time() - t0),
    )
    # per MoE layer: Sigma_k of the rollout engine and of the training engine's pass over the same response tokens
    metrics.update({f"confidence_rollout/{k}": float(v) for k, v in gen["routing_confidence_layers"].items()})
    metrics.update({f"confidence_score/{k}": float(v) for k, v in conf_score.items()})
    if metrics["skipped"]:
      log(f"rl: generation {step + 1}: {int(metrics['skipped'])} non-finite update(s) skipped")
    if due(step + 1, rc.eval_every, rc.steps):
      acc = evaluate.accuracy(
        config, {"params": state["actor"]["params"], "router": state["actor"]["router"]}, tok, eval_set
      )
      metrics.update({f"eval/{k}": v for k, v in acc.items()})
      clock.stop("eval")
      log(f"rl: generation {step + 1}: held-out accuracy {acc['accuracy']:.3f} (SFT {acc0['accuracy']:.3f})")
    metrics.update(clock.seconds())
    writer.write(step + 1, metrics)
    prog.update(step + 1, metrics)
    if due(step + 1, rc.checkpoint_every, rc.steps):
      ckpt.save(step + 1, state, {"data": data.get_state()}, force=True)
  writer.close()
  ckpt.wait()
  if start >= rc.steps:
    acc = evaluate.accuracy(
      config, {"params": state["actor"]["params"], "router": state["actor"]["router"]}, tok, eval_set
    )
  return finish(config, workdir, acc0, acc, log)


def finish(config, workdir, acc0, acc, log):
  rl_dir = os.path.join(workdir, "rl")
  jsonl = os.path.join(rl_dir, "metrics_rl.jsonl")
  plot_metrics(
    jsonl,
    [
      "reward",
      "accuracy",
      "eval/accuracy",
      "actor_grad_norm",
      "critic_loss",
      "kept_frac",
      "token_keep_frac",
      "traj_keep_frac",
      "entropy",
      "kl",
      "confidence_rollout",
      "confidence_train",
      "truncation_rate",
    ],
    os.path.join(workdir, "rl.png"),
    title=f"RL ({config.rl.objective})",
  )
  rows = [r for r in read_jsonl(jsonl) if "reward" in r]
  gn = np.array([r["actor_grad_norm"] for r in rows if "actor_grad_norm" in r])
  summary = {
    "objective": config.rl.objective,
    "generations": len(rows),
    "accuracy_before": acc0["accuracy"],
    "accuracy_after": acc["accuracy"],
    "gain_points": 100 * (acc["accuracy"] - acc0["accuracy"]),
    "train_reward_first10": float(np.mean([r["reward"] for r in rows[:10]])) if rows else float("nan"),
    "train_reward_last10": float(np.mean([r["reward"] for r in rows[-10:]])) if rows else float("nan"),
    "actor_grad_norm_mean": float(gn.mean()) if gn.size else float("nan"),
    "actor_grad_norm_std": float(gn.std()) if gn.size else float("nan"),
  }
  table = summary_table([summary], list(summary))
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  with open(os.path.join(workdir, "summary.md"), "w") as f:
    f.write(table + "\n")
  log(table)
  log(
    f"plots: {os.path.join(workdir, 'sft', 'sft.png')}, {os.path.join(workdir, 'rl.png')}; "
    f"TensorBoard: tensorboard --logdir {workdir}"
  )
  return summary
