"""RL with a critic (docs/rl.md §1): SFT -> [rollout -> rewards -> values -> advantages -> mini-batch updates]*.

One generation:
  1. the rollout engine (its own numerics, bf16 by default) samples `samples_per_prompt` responses per prompt and
     records logp_rollout = log pi_vllm(a_t | s_t); the sampling actor is rl.max_staleness generations old, and
     with rl.async its rollout runs in a background thread while the previous generation trains (rollouts.py);
  2. rule rewards; truncated responses get V(s_T) (truncation-aware bootstrapping) or 0 / the task reward; with
     rl.oversample = m > 1 the rollout had m x prompts_per_step prompts and the prompts_per_step whose rewards
     vary most go on (dynamic sampling);
  3. the training engine (fp32) recomputes logp_old with the pre-update actor, logp_ref with the frozen SFT
     params (unbiased KL) and V(s_t) with the critic (three independent programs, run side by side); GAE
     (gamma = lambda = 1: A_t = R - V(s_t));
  4. one epoch: `actor_minibatches` actor updates with the configured objective (MIS-PO / PPO / GSPO / TIS)
     + kl_coef * unbiased KL (from generation rl.kl_start on), and `critic_minibatches` critic updates (value
     loss), each a compiled step (Muon); the actor's and the critic's updates are independent and run side by side.
Everything per generation is logged (reward, accuracy, grad norms, keep fractions, entropy, KL, truncation, routing
confidence on the rollout and on the training pass, mean and per MoE layer, stage times, throughput); held-out
greedy accuracy at intervals. The compiled programs live in programs.py, the host batches in batches.py, the
state, engines and sampler in build.py; warmup.py compiles the programs beside SFT (rl.compile_ahead).
"""

from __future__ import annotations

import functools
import json
import os
import time
import types

import jax.numpy as jnp
import numpy as np

from stepflash_jax import model as model_lib
from stepflash_jax import parallel
from stepflash_jax.agents.rollout import tool_metrics
from stepflash_jax import hf
from stepflash_jax.data import jsonl, prompt_dataset
from stepflash_jax.files import atomic_write
from stepflash_jax.rl.build import compile_programs, generation_rng, init_state, sampler
from stepflash_jax.rl.batches import informative_rows, minibatches, repeat_prompts, reward_spread, sequences, take_rows
from stepflash_jax.rl.programs import Programs, kl_coef_at
from stepflash_jax.rl import packing, reward_training, warmup
from stepflash_jax.rl.rewards import score_batch
from stepflash_jax.rl.rollouts import RolloutQueue
from stepflash_jax.train import evaluate, sft
from stepflash_jax.train.checkpoint import Checkpointer
from stepflash_jax.train.metrics import MetricsWriter, Progress, StageClock, plot_metrics, read_jsonl, summary_table
from stepflash_jax.train.step import due, frozen_mask


def run(config, workdir: str, log=print):
  """The main job: SFT (or reuse its checkpoint) -> held-out eval -> RL -> eval, summary, plots."""
  config = hf.resolve_model(config)  # model.hf_dir: the checkpoint's architecture
  reward_training.check_config(config)
  mesh, rules = parallel.make_mesh(config.mesh), parallel.rules(config)
  with parallel.use_mesh(mesh, rules):
    return _run(config, workdir, log, mesh, rules)


def sft_dir(config, workdir: str) -> str:
  """The SFT run of an RL run: rl.sft_workdir, else <workdir>/sft."""
  return config.rl.get("sft_workdir") or os.path.join(workdir, "sft")


def sft_stage(config, workdir, log):
  """The SFT stage: trained in <workdir>/sft on the first run, resumed / reused afterwards (rl.sft_workdir points
  several RL runs, e.g. the mismatch lab's variants, at one SFT run). With rl.mixture the RL prompts and held-out
  problems come from that mixture instead of data.mixture. -> (config for RL, tokenizer, reference variables,
  the SFT policy's held-out accuracy, the held-out problems)."""
  rc = config.rl
  reuse = "rl.sft_workdir" if rc.get("sft_workdir") else None
  out = sft.train(config, sft_dir(config, workdir), log=log, reuse=reuse)
  tok, ref, acc0 = out["tokenizer"], out["variables"], out["accuracy"]
  ref = {"params": ref["params"], "router": ref["router"]}
  if rc.get("mixture") and rc.mixture != config.data.mixture:  # e.g. SFT on 2-3 digit, RL on 3-digit problems
    config = config.copy_and_resolve_references()
    config.data.mixture = rc.mixture
    eval_set = evaluate.heldout_examples(config, tok)
    return config, tok, ref, evaluate.accuracy(config, ref, tok, eval_set), eval_set
  return config, tok, ref, acc0, evaluate.heldout_examples(config, tok)


def _prompts(config, tok, log):
  """The RL prompts: batches of rl.prompts_per_step x rl.oversample from the config's mixture (or its train file),
  seed + 1."""
  examples = jsonl.config_examples(config, tok, "train", log)
  return prompt_dataset(
    tok,
    batch_size=config.rl.prompts_per_step * config.rl.get("oversample", 1),
    max_prompt_len=config.data.max_prompt_len,
    mixture=config.data.mixture,
    seed=config.seed + 1,
    examples=examples,
  )


def _ahead_stages(config, workdir):
  """With rl.compile_ahead, when the SFT stage has steps to train: the held-out evaluation's and the RL stage's
  programs, for warmup.ahead beside it."""
  if not config.rl.get("compile_ahead") or sft.finished(sft_dir(config, workdir), config.train.steps):
    return []
  return [("held-out eval", warmup.compile_eval, config), ("rl", warmup.compile_rl, config)]


def _run(config, workdir, log, mesh, rules):
  with warmup.ahead(_ahead_stages(config, workdir)):
    config, tok, ref, acc0, eval_set = sft_stage(config, workdir, log)
  rc = config.rl
  args = model_lib.as_args(config.model)
  P = config.data.max_prompt_len
  log(f"rl: SFT held-out accuracy {acc0['accuracy']:.3f}")
  reward = reward_training.reward_for(config, workdir, ref, tok, mesh, rules, log)  # learned ones trained here
  acc0, held_out = evaluator(config, tok, eval_set, ref, acc0)
  state, actor_tx, critic_tx = init_state(config, ref, args, mesh, rules)
  data = iter(_prompts(config, tok, log))
  rl_dir = os.path.join(workdir, "rl")
  ckpt = Checkpointer(os.path.join(rl_dir, "checkpoints"), max_to_keep=config.train.keep_checkpoints)
  actor_vars = lambda: {"params": state["actor"]["params"], "router": state["actor"]["router"]}
  s = rc.get("max_staleness", 0)
  behind = [actor_vars()] * s  # the actors of generations start - s .. start - 1 (rollouts.py)
  start = ckpt.latest_step() or 0
  if start:
    state, extra = ckpt.restore(start, target={**state, "behind": behind} if s else state)
    behind = state.pop("behind", [])
    data.set_state(extra["data"])
    log(f"rl: resumed from generation {start} in {rl_dir}")
  writer = MetricsWriter(rl_dir, "rl", resume_step=start if start else -1)  # a fresh start drops a stale log
  if not start:  # generation 0 = the SFT policy: the curves' first point
    writer.write(0, {f"eval/{k}": v for k, v in acc0.items()})
  fns = Programs(args, rc, actor_tx, critic_tx, P, frozen_mask(ref["params"], rc.freeze_router))
  sample, close_engine = sampler(config, tok, mesh, rules)

  repeat = functools.partial(repeat_prompts, n=rc.samples_per_prompt)
  queue = RolloutQueue(sample, data, s, background=rc.get("async", False), prepare=repeat)
  queue.start(start, rc.steps, behind)
  prog = Progress(
    rc.steps,
    every=rc.log_every,
    desc=f"rl/{rc.objective}",
    start_step=start,
    keys=["reward", "accuracy", "actor_grad_norm", "critic_loss", "kept_frac", "confidence_rollout"],
  )
  acc = acc0
  ctx = types.SimpleNamespace(
    config=config, fns=fns, ref=ref, tok=tok, mesh=mesh, rules=rules, start=start, reward=reward
  )
  try:
    for step in range(start, rc.steps):
      t0, clock = time.time(), StageClock()
      queue.advance(step, rc.steps, actor_vars())  # generation step + s: sampled by this actor
      prompts, gen, version = queue.take(step)
      clock.stop("rollout")
      state, metrics = train_generation(ctx, state, step, prompts, gen, clock)
      metrics.update(staleness=float(step - version), rollout_sample_s=gen["sample_seconds"])
      metrics["tokens_per_s"] = metrics["response_tokens"] * len(gen["response"]) / (time.time() - t0)
      if metrics["skipped"]:
        log(f"rl: generation {step + 1}: {int(metrics['skipped'])} non-finite update(s) skipped")
      if due(step + 1, rc.eval_every, rc.steps):
        acc = held_out(actor_vars())
        metrics.update({f"eval/{k}": v for k, v in acc.items()})
        clock.stop("eval")
        log(f"rl: generation {step + 1}: held-out accuracy {acc['accuracy']:.3f} (SFT {acc0['accuracy']:.3f})")
      metrics.update(clock.seconds())
      writer.write(step + 1, metrics)
      prog.update(step + 1, metrics)
      if due(step + 1, rc.checkpoint_every, rc.steps):
        behind, data_state = queue.checkpoint()
        ckpt.save(step + 1, {**state, "behind": behind} if s else state, {"data": data_state}, force=True)
  finally:
    queue.close()
    close_engine()
  writer.close()
  ckpt.wait()
  if start >= rc.steps:
    acc = held_out(actor_vars())
  hf.export(config.model, actor_vars(), tok, os.path.join(workdir, "hf"))  # experiments/generate.py reads it
  return finish(config, workdir, acc0, acc, log)


def evaluator(config, tok, eval_set, ref, acc0):
  """(acc0 + the SFT policy's gold metrics, held_out(variables) -> greedy accuracy + the gold score and the win
  rate against the SFT policy); the gold metrics only for tasks with a hidden gold scorer (train/evaluate.py)."""
  sft_gold = evaluate.sampled_gold(config, ref, tok, eval_set)

  def held_out(variables):
    acc = evaluate.accuracy(config, variables, tok, eval_set)
    return {**acc, **evaluate.gold_metrics(evaluate.sampled_gold(config, variables, tok, eval_set), sft_gold)}

  return {**acc0, **evaluate.gold_metrics(sft_gold, sft_gold)}, held_out


def train_generation(ctx, state, step, prompts, gen, clock):
  """Steps 2-4 of one generation on its rollout: rewards, scoring, advantages, the update epoch.
  Returns (state, the generation's metrics)."""
  rc, fns = ctx.config.rl, ctx.fns
  texts = [ctx.tok.decode(r, stop_at_eos=True) for r in np.asarray(gen["response"])]
  filters = tuple(rc.get("reward_filters", ()))
  scored = score_batch(ctx.reward, prompts["examples"], texts, np.asarray(gen["truncated"]), filters=filters)
  clock.stop("reward")
  rng = generation_rng(ctx.config.seed, step)[1]
  sampled = {}
  if rc.get("oversample", 1) > 1:  # dynamic sampling: train on the prompts whose rewards vary most
    spread = reward_spread(scored["reward"], rc.samples_per_prompt)
    sampled = {"sampled_reward": float(np.mean(scored["reward"])), "sampled_informative": float(np.mean(spread > 0))}
    rows = informative_rows(spread, rc.samples_per_prompt, rc.prompts_per_step, rng)
    prompts, gen, scored = (take_rows(x, rows, len(texts)) for x in (prompts, gen, scored))
  batch = sequences(prompts, gen)
  if step == ctx.start:
    compile_programs(fns, state, batch, rc, ctx.mesh, ctx.rules)
    clock.stop("compile")
  # router replay (docs/rl.md §8): always, or when the rollout's routing confidence is low
  replay = rc.router_replay == "always" or (
    rc.router_replay == "auto" and float(gen["routing_confidence"]) < rc.replay_threshold
  )
  scores = score_generation(fns, state, ctx.ref, batch, scored, rc, ctx.mesh, ctx.rules, replay)
  clock.stop("score")
  state, am, cm = update(fns, state, batch, rc, step, rng, ctx.mesh, ctx.rules, replay)
  clock.stop("update")
  metrics = {**generation_metrics(batch, gen, scored, scores, am, cm), **sampled}
  metrics["router_replay"] = float(replay)
  if "turns" in gen:  # multi-turn tool use
    metrics.update(tool_metrics(gen))
  return state, metrics


def score_generation(fns, state, ref, batch, scored, rc, mesh, rules, replay=False) -> dict:
  """logp_old, entropy, Sigma_k and expert flips (actor), logp_ref (SFT policy), values (critic): independent
  programs run side by side (with router replay, logp_old comes from a second actor pass on the rollout's
  experts); then advantages, returns and the mismatch statistics. Adds logp_old, logp_ref, adv and returns (host
  arrays) to `batch`; returns the generation's scoring outputs."""
  jb = parallel.shard_batch(packing.add(batch, rc.get("pack", 0.0)), mesh, rules, global_batch=True)
  actor, critic = state["actor"], state["critic"]
  thunks = dict(
    actor=lambda: fns.score(actor["params"], actor["router"], jb),
    values=lambda: fns.values(critic["params"], critic["router"], jb),
  )
  if replay:
    thunks["replayed"] = lambda: fns.score(actor["params"], actor["router"], jb, replay=True)[0]
  if rc.kl_coef > 0:
    thunks["ref"] = lambda: fns.score(ref["params"], ref["router"], jb)[0]
  out = parallel.concurrently(**thunks)
  logp_own, entropy, conf, flips = out["actor"]
  logp_old = out.get("replayed", logp_own)
  logp_ref = out.get("ref", logp_own)
  adv, ret = fns.advantages(out["values"], jb["mask"], jnp.asarray(scored["reward"]), jnp.asarray(scored["truncated"]))
  mismatch = fns.mismatch({"logp_old": logp_old, "logp_rollout": jb["logp_rollout"], "mask": jb["mask"]})
  if replay:  # the same statistics without replay, for comparison
    own = fns.mismatch({"logp_old": logp_own, "logp_rollout": jb["logp_rollout"], "mask": jb["mask"]})
    mismatch.update({f"{k}_noreplay": v for k, v in own.items() if k.startswith("logp_abs_diff")})
  host = dict(logp_old=logp_old, logp_ref=logp_ref, adv=adv, returns=ret, entropy=entropy, conf=conf, flips=flips)
  host = parallel.to_host({**host, "values": out["values"]})
  batch.update({k: np.asarray(host.pop(k)) for k in ("logp_old", "logp_ref", "returns")})
  batch["adv"] = np.asarray(host["adv"])  # one host copy, shared with the returned scores
  return {**host, "mismatch": parallel.to_host(mismatch)}


def update(fns, state, batch, rc, step, rng, mesh, rules, replay=False):
  """One epoch over the generation: rl.actor_minibatches actor updates (router replay on the rollout's experts if
  `replay`) and rl.critic_minibatches critic updates, the two sequences side by side (neither reads the other's
  parameters). Returns (state, actor and critic metrics per update, on the host)."""
  pack = rc.get("pack", 0.0)
  amb = list(minibatches(batch, rc.actor_minibatches, rng, mesh, rules, pack))
  cmb = list(minibatches(batch, rc.critic_minibatches, rng, mesh, rules, pack))
  kl_coef = jnp.float32(kl_coef_at(rc, step))

  def epoch(step_fn, s, mbs, *extra):
    out = []
    for mb in mbs:
      s, m = step_fn(s, mb, *extra)
      out.append(m)
    return s, out

  done = parallel.concurrently(
    actor=lambda: epoch(functools.partial(fns.actor_step, replay=replay), state["actor"], amb, kl_coef),
    critic=lambda: epoch(fns.critic_step, state["critic"], cmb),
  )
  state = {**state, "actor": done["actor"][0], "critic": done["critic"][0], "step": state["step"] + 1}
  am, cm = parallel.to_host(done["actor"][1]), parallel.to_host(done["critic"][1])
  packed = float(np.mean([packing.packed(mb) for mb in amb + cmb]))  # rl.pack: the mini-batches that fit
  return state, [{**m, "packed_frac": packed} for m in am], cm


def generation_metrics(batch, gen, scored, scores, am, cm) -> dict:
  """The generation's log row: means over the actor / critic updates, rewards, mismatch, routing confidence."""
  gn = np.array([m["actor_grad_norm"] for m in am])
  n_tok = float(batch["mask"].sum())
  conf = scores["conf"]
  metrics = {k: float(np.mean([m[k] for m in am])) for k in am[0] if k != "skipped"}
  metrics.update({k: float(np.mean([m[k] for m in cm])) for k in ("critic_loss", "critic_grad_norm")})
  metrics.update({k: float(v) for k, v in scores["mismatch"].items()})  # the whole generation's
  metrics.update(
    reward=float(scored["reward"].mean()),
    accuracy=float(scored["correct"].mean()),
    truncation_rate=float(scored["truncated"].mean()),
    actor_grad_norm_max=float(gn.max()),
    entropy=float(scores["entropy"]),
    confidence_rollout=float(gen["routing_confidence"]),
    confidence_score=float(np.mean(list(conf.values()))) if conf else float("nan"),
    response_tokens=n_tok / len(batch["mask"]),
    **{f"response_tokens_{k}": float(v) for k, v in zip(("p10", "p50", "p90", "max"), length_quantiles(batch))},
    value_mean=float(scores["values"].mean()),
    advantage_mean=float(scores["adv"].sum() / max(n_tok, 1)),
    skipped=float(sum(m["skipped"] for m in am) + sum(m["skipped"] for m in cm)),
  )
  if np.isfinite(scored["gold"]).any():  # tasks with a hidden gold scorer (the reward may be a learned proxy)
    metrics["gold"] = float(np.nanmean(scored["gold"]))
  # samples whose reward was forced to 0 (empty, a filter, unparsed by the judge, non-finite): fractions
  metrics.update({f"reward_zeroed/{k}": float(np.mean(v)) for k, v in scored["zeroed"].items()})
  # per MoE layer: Sigma_k of the rollout engine and of the training engine's pass over the same response tokens
  metrics.update({f"confidence_rollout/{k}": float(v) for k, v in gen["routing_confidence_layers"].items()})
  metrics.update({f"confidence_score/{k}": float(v) for k, v in conf.items()})
  # expert flips: response tokens whose top-k set differs between the rollout engine and the training pass
  flips = scores["flips"]
  metrics["flip_rate"] = float(np.mean(list(flips.values()))) if flips else 0.0
  metrics.update({f"flip_rate/{k}": float(v) for k, v in flips.items()})
  return metrics


def length_quantiles(batch):
  """The generation's response-length distribution: 10th, 50th, 90th percentile and maximum (tokens)."""
  lens = batch["mask"].sum(1)
  return (*np.percentile(lens, [10, 50, 90]), lens.max())


def finish(config, workdir, acc0, acc, log):
  rl_dir = os.path.join(workdir, "rl")
  metrics_file = os.path.join(rl_dir, "metrics_rl.jsonl")
  plot_metrics(
    metrics_file,
    [
      ("reward", "gold"),  # the proxy and the hidden gold score (preference runs: over-optimisation shows here)
      "accuracy",
      "eval/accuracy",
      ("eval/gold", "eval/win_rate_vs_sft"),
      "response_tokens",
      "actor_grad_norm",
      "critic_loss",
      "kept_frac",
      "token_keep_frac",
      "traj_keep_frac",
      "entropy",
      "kl",
      "confidence_rollout",
      "confidence_train",
      "flip_rate",
      "truncation_rate",
      "tool_calls",  # agent runs only (absent keys are skipped)
      "turns",
      "parse_error_rate",
      "tool_error_rate",
    ],
    os.path.join(workdir, "rl.png"),
    title=f"RL ({config.rl.objective})",
  )
  rows = [r for r in read_jsonl(metrics_file) if "reward" in r]
  gn = np.array([r["actor_grad_norm"] for r in rows if "actor_grad_norm" in r])
  summary = {
    "objective": config.rl.objective,
    "generations": len(rows),
    "accuracy_before": acc0["accuracy"],
    "accuracy_after": acc["accuracy"],
    "gain_points": 100 * (acc["accuracy"] - acc0["accuracy"]),
    **(
      {"gold_before": acc0["gold"], "gold_after": acc["gold"], "win_rate_vs_sft": acc["win_rate_vs_sft"]}
      if "gold" in acc
      else {}
    ),
    "train_reward_first10": float(np.mean([r["reward"] for r in rows[:10]])) if rows else float("nan"),
    "train_reward_last10": float(np.mean([r["reward"] for r in rows[-10:]])) if rows else float("nan"),
    "actor_grad_norm_mean": float(gn.mean()) if gn.size else float("nan"),
    "actor_grad_norm_std": float(gn.std()) if gn.size else float("nan"),
  }
  table = summary_table([summary], list(summary))
  atomic_write(os.path.join(workdir, "summary.json"), json.dumps(summary, indent=1))
  atomic_write(os.path.join(workdir, "summary.md"), table + "\n")
  log(table)
  log(
    f"plots: {os.path.join(workdir, 'sft', 'sft.png')}, {os.path.join(workdir, 'rl.png')}; "
    f"TensorBoard: tensorboard --logdir {workdir}"
  )
  return summary
