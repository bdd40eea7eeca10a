"""Preference data and reward-model training (docs/rewards.md §1-3): the stage between SFT and RL against a learned
reward (configs/preference.py).

1. Pairs: the SFT policy samples two responses per prompt (temperature 1, the rollout engine); each is scored by the
   task's hidden gold scorer (tasks/pref.py) and the pair is labelled with Bradley-Terry noise,
   P(a preferred to b) = sigmoid((gold_a - gold_b) / tau)  (reward_model.label_tau: the noise knob);
   reward_model.label_length_bias adds bias * (length_a - length_b) (tokens) inside: labellers who like long answers.
   Train pairs come from train-split prompts, held-out pairs from test-split prompts; both are written as JSONL
   (<workdir>/preferences/{train,test}.jsonl, one pair per line) and reused when present.
2. Training (reward_models.bt_loss / genrm_loss): Muon, warmup + cosine, batches drawn by a generator seeded with
   (seed, step), so a run resumed from its last checkpoint (every train.checkpoint_every steps) draws the same
   batches; checkpoints and metrics in <workdir>/reward_<kind>/; a finished model is restored, not retrained.
   The GenRM sees each pair in a random orientation (either answer as the reference).
3. Held-out pairwise accuracy against the gold order (pairs with equal gold left out), beside the ceiling: the
   accuracy of the noisy labels themselves. For both models the pair is read symmetrically,
   P(b > a) = (c(b | ref a) + 1 - c(a | ref b)) / 2 (for BT this is exactly r_b > r_a).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from stepflash_jax import model as model_lib
from stepflash_jax import parallel
from stepflash_jax.checks import is_number
from stepflash_jax.data import tasks
from stepflash_jax.data.pipeline import example_dataset
from stepflash_jax.data.tokenizer import symbols
from stepflash_jax.parallel.mesh import config_error
from stepflash_jax.rl import reward_models as rm_lib
from stepflash_jax.rl import rewards
from stepflash_jax.rl.critic import critic_from_actor
from stepflash_jax.sampling import RolloutEngine
from stepflash_jax.train import state as state_lib
from stepflash_jax.files import atomic_write
from stepflash_jax.train.checkpoint import Checkpointer
from stepflash_jax.train.evaluate import padded_prompts
from stepflash_jax.train.metrics import MetricsWriter, Progress, read_jsonl
from stepflash_jax.train.step import due, frozen_mask, guarded_update, lr_schedule, make_optimizer


def write_jsonl(path: str, records) -> None:
  """Atomically (files.atomic_write)."""
  atomic_write(path, "".join(json.dumps(r) + "\n" for r in records))


def bt_label(gold_a, gold_b, tau: float, rng) -> np.ndarray:
  """1 where b is preferred: Bernoulli(sigmoid((gold_b - gold_a) / tau)); tau = 0 gives the noiseless order (ties:
  a fair coin)."""
  gold_a, gold_b = np.asarray(gold_a, np.float64), np.asarray(gold_b, np.float64)
  if tau == 0:
    p = np.where(gold_b > gold_a, 1.0, np.where(gold_b < gold_a, 0.0, 0.5))
  else:
    p = rm_lib.sigmoid((gold_b - gold_a) / tau)
  return (rng.random(p.shape) < p).astype(np.int32)


def sample_pairs(config, variables, tok, split: str, num_prompts: int, seed: int) -> list[dict]:
  """Two SFT samples per prompt of `split`, their gold scores and a Bradley-Terry label (module docstring)."""
  r, m = config.rl, config.reward_model
  ds = example_dataset(
    mixture=config.data.mixture, split=split, seed=seed, num_examples=num_prompts, num_epochs=1, shuffle=False
  )
  examples = [ds[i] for i in range(num_prompts)]
  engine = RolloutEngine(
    config.model,
    max_prompt_len=config.data.max_prompt_len,
    max_new_tokens=r.max_new_tokens,
    eos_id=tok.eos_id,
    pad_id=tok.pad_id,
    dtype=r.rollout_dtype,
    temperature=1.0,
  )
  rows, n = [ex for ex in examples for _ in range(2)], m.sample_batch
  texts = []
  for i in range(0, len(rows), n):
    chunk = rows[i : i + n]
    p = padded_prompts(config, tok, chunk, rows=n)  # one compiled shape
    out = engine.generate(variables, p["tokens"], p["lengths"], jax.random.fold_in(jax.random.key(seed), i))
    texts += [tok.decode(t, stop_at_eos=True) for t in np.asarray(out["response"])[: len(chunk)]]
  gold = np.array([tasks.get_task(ex["family"]).gold(ex, t) for ex, t in zip(rows, texts)]).reshape(-1, 2)
  # labellers with a verbosity bias judge gold + bias * length (tokens): the bias reward models learn from people
  length = np.array([len(tok.encode(t)) for t in texts], np.float64).reshape(-1, 2)
  seen = gold + m.get("label_length_bias", 0.0) * length
  label = bt_label(seen[:, 0], seen[:, 1], m.label_tau, np.random.default_rng([seed, 7]))
  keep = ("prompt", "answer", "family", "difficulty", "metadata")
  return [
    dict(
      example={k: ex[k] for k in keep},
      a=texts[2 * i],
      b=texts[2 * i + 1],
      gold_a=float(gold[i, 0]),
      gold_b=float(gold[i, 1]),
      label=int(label[i]),
    )
    for i, ex in enumerate(examples)
  ]


def pairs(config, variables, tok, workdir: str, log=print) -> dict:
  """{"train", "test"}: the preference pairs, sampled and written on the first call, read back afterwards."""
  m, out = config.reward_model, {}
  for split, n, seed in (("train", m.train_prompts, config.seed + 11), ("test", m.test_prompts, config.seed + 12)):
    path = os.path.join(workdir, "preferences", f"{split}.jsonl")
    if not os.path.exists(path):
      write_jsonl(path, sample_pairs(config, variables, tok, split, n, seed))
      log(f"reward model: wrote {n} {split} preference pairs to {path}")
    out[split] = read_jsonl(path)
  return out


def decisive(records) -> list[dict]:
  """The pairs whose gold scores differ: the ones a gold order exists for."""
  return [r for r in records if r["gold_a"] != r["gold_b"]]


def ceiling(records) -> float:
  """Accuracy of the noisy labels against the gold order (pairs with equal gold left out)."""
  rec = decisive(records)
  return float(np.mean([(r["label"] == 1) == (r["gold_b"] > r["gold_a"]) for r in rec])) if rec else float("nan")


def heldout_accuracy(reward: rm_lib.LearnedReward, records) -> float:
  """Pairwise accuracy against the gold order on pairs with unequal gold, P(b > a) read symmetrically."""
  rec = decisive(records)
  if not rec:
    return float("nan")
  prompts = [r["example"]["prompt"] for r in rec]
  a, b = [r["a"] for r in rec], [r["b"] for r in rec]
  p_b = 0.5 * (reward.confidence(prompts, a, b)[0] + 1.0 - reward.confidence(prompts, b, a)[0])
  return float(np.mean((p_b > 0.5) == np.array([r["gold_b"] > r["gold_a"] for r in rec])))


def training_batch(kind: str, tok, records, idx, rng, max_len: int) -> dict:
  """The batch of pairs `idx`: BT rows chosen then rejected; GenRM judge rows in a random orientation."""
  rows, label = [], []
  if kind == "bt":
    for pick in (1, 0):  # chosen (label side), then rejected
      for i in idx:
        r = records[i]
        rows.append(rm_lib.bt_row(tok, r["example"]["prompt"], r["b"] if r["label"] == pick else r["a"]))
  else:
    for i, flip in zip(idx, rng.random(len(idx)) < 0.5):
      r = records[i]
      ref, cand, b_wins = (r["b"], r["a"], 1 - r["label"]) if flip else (r["a"], r["b"], r["label"])
      rows.append(rm_lib.genrm_row(tok, r["example"]["prompt"], ref, cand))
      label.append(0 if b_wins else 1)  # 0 = "better": the candidate is preferred
  tokens, lengths = rm_lib.pad_rows(rows, max_len, tok.pad_id)
  batch = {"tokens": tokens, "lengths": lengths}
  if kind == "genrm":
    batch["label"] = np.array(label, np.int32)
  return batch


def width(config, kind: str) -> int:
  """Row width of a reward model's inputs: the judge template (reward_model.max_len) for the GenRM, a chat prompt and
  a response (data.max_prompt_len + rl.max_new_tokens + eos) for BT."""
  return config.reward_model.max_len if kind == "genrm" else config.data.max_prompt_len + config.rl.max_new_tokens + 1


def train(config, kind: str, workdir: str, sft_variables, tok, records, mesh, rules, log=print):
  """Trains (or resumes, or restores when finished) the reward model `kind` on `records`; returns its variables."""
  m, args = config.reward_model, model_lib.as_args(config.model)
  init = critic_from_actor(sft_variables) if kind == "bt" else sft_variables
  init = state_lib.place_state({"params": init["params"], "router": init["router"]}, args, mesh, rules)
  lr_fn = lr_schedule(m.lr[kind], m.steps, config.optim.warmup_frac, config.optim.end_lr_frac)
  tx = make_optimizer(config.optim, lr_fn)
  state = {**init, "opt": state_lib.init_opt_state(tx, init["params"], args, mesh, rules), "step": jnp.int32(0)}
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=2)
  start = ckpt.latest_step() or 0
  if start:
    state, _ = ckpt.restore(start, target=state)
  if start >= m.steps:
    return {"params": state["params"], "router": state["router"]}
  ids = jnp.asarray(rm_lib.verdict_ids(tok)) if kind == "genrm" else None
  loss = (
    (lambda p, r, b: rm_lib.bt_loss(p, r, b, args))
    if kind == "bt"
    else (lambda p, r, b: rm_lib.genrm_loss(p, r, b, args, ids))
  )
  mask = frozen_mask(state["params"], True)  # the router stays frozen, as in SFT

  @jax.jit
  def step_fn(state, batch):
    (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(state["params"], state["router"], batch)
    params, opt, gnorm, skipped = guarded_update(state, grads, value, tx, mask)
    metrics.update(grad_norm=gnorm, skipped=skipped, lr=lr_fn(state["step"]))
    return {**state, "params": params, "opt": opt, "step": state["step"] + 1}, metrics

  writer = MetricsWriter(workdir, f"reward_{kind}", resume_step=start)
  prog = Progress(
    m.steps, every=config.train.log_every, desc=f"reward_{kind}", keys=["loss", "accuracy"], start_step=start
  )
  for step in range(start, m.steps):
    rng = np.random.default_rng([config.seed, step])
    idx = rng.choice(len(records), size=m.batch_size, replace=False)
    batch = parallel.shard_batch(training_batch(kind, tok, records, idx, rng, width(config, kind)), mesh, rules)
    state, metrics = step_fn(state, batch)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if metrics["skipped"]:
      log(f"reward_{kind}: step {step + 1} skipped (non-finite loss or gradient)")
    writer.write(step + 1, metrics)
    prog.update(step + 1, metrics)
    if due(step + 1, config.train.checkpoint_every, m.steps):
      ckpt.save(step + 1, state, {}, force=True)
  ckpt.wait()
  writer.close()
  return {"params": state["params"], "router": state["router"]}


def learned_reward(config, kind, variables, tok) -> rm_lib.LearnedReward:
  m = config.reward_model
  return rm_lib.LearnedReward(
    kind,
    config.model,
    variables,
    tok,
    max_len=width(config, kind),
    batch_size=m.score_batch,
    length_penalty=m.length_penalty,
    min_verdict_mass=m.min_verdict_mass,
  )


def prepare(config, workdir: str, sft_variables, tok, mesh, rules, log=print, kind=None) -> rm_lib.LearnedReward:
  """Pairs -> every model of reward_model.train (held-out accuracies and the ceiling logged and written to
  <workdir>/reward_models.jsonl) -> the LearnedReward of `kind` (default rl.reward: "bt" | "genrm"). Runs inside
  the mesh context. reward_model.workdir: another run's directory whose pairs and models to reuse ("" = this
  run's)."""
  kind = kind or config.rl.reward
  if kind not in config.reward_model.train:
    raise ValueError(f"reward {kind!r} needs it in reward_model.train={tuple(config.reward_model.train)}")
  workdir = config.reward_model.get("workdir") or workdir
  data = pairs(config, sft_variables, tok, workdir, log)
  summary, rewards = {"ceiling": ceiling(data["test"]), "label_tau": config.reward_model.label_tau}, {}
  for k in config.reward_model.train:
    rm_dir = os.path.join(workdir, f"reward_{k}")
    v = train(config, k, rm_dir, sft_variables, tok, data["train"], mesh, rules, log)
    rewards[k] = learned_reward(config, k, v, tok)
    summary[f"{k}_heldout_accuracy"] = heldout_accuracy(rewards[k], data["test"])
  log("reward models: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
  write_jsonl(os.path.join(workdir, "reward_models.jsonl"), [summary])
  return rewards[kind]


def reward_for(config, workdir, sft_variables, tok, mesh, rules, log=print):
  """What rewards.score_batch gets for rl.reward: a LearnedReward ("bt" | "genrm", trained or restored here), the
  rubric reward with rl.rubric_mapping, or the registered name; with rl.family_rewards ({family: reward}), a
  rewards.ByFamily that gives those families' samples their own reward."""

  def one(name):
    if name in rm_lib.KINDS:
      return prepare(config, workdir, sft_variables, tok, mesh, rules, log, kind=name)
    if name == "rubric" and config.rl.get("rubric_mapping"):
      return rewards.make_rubric_reward(dict(config.rl.rubric_mapping))
    return name

  by_family = dict(config.rl.get("family_rewards") or {})
  if not by_family:
    return one(config.rl.reward)
  made = {name: one(name) for name in {config.rl.reward, *by_family.values()}}  # each reward model loaded once
  return rewards.ByFamily(made[config.rl.reward], {f: made[n] for f, n in by_family.items()})


def check_config(c) -> None:
  """The reward fields of an RL config (rl.reward, rl.reward_filters, rl.rubric_mapping, the reward_model section):
  a one-line ValueError naming the field, before anything runs."""
  r = c.rl
  by_family = dict(r.get("family_rewards") or {})
  for field, name in [("rl.reward", r.reward)] + [(f"rl.family_rewards.{f}", n) for f, n in by_family.items()]:
    if name not in rm_lib.KINDS + tuple(rewards.available_rewards()):
      config_error(field, f"must be one of {rm_lib.KINDS} (learned) or {rewards.available_rewards()}, got {name!r}")
  unknown = sorted(set(by_family) - set(tasks.families()))
  if unknown:
    config_error("rl.family_rewards", f"unknown task families {unknown}; known: {tasks.families()}")
  for f in r.get("reward_filters", ()):
    if f not in rewards.available_filters():
      config_error("rl.reward_filters", f"unknown filter {f!r}; registered: {rewards.available_filters()}")
  if r.get("rubric_mapping"):
    try:
      rewards.make_rubric_reward(dict(r.rubric_mapping))
    except ValueError as e:
      config_error("rl.rubric_mapping", str(e))
  learned = sorted({r.reward, *by_family.values()} & set(rm_lib.KINDS))
  if not learned:
    return
  if "reward_model" not in c:
    config_error("reward_model", f"{learned} are learned rewards: the config needs a reward_model section")
  m = c.reward_model
  if not set(learned) <= set(m.train) or any(k not in rm_lib.KINDS for k in m.train):
    config_error("reward_model.train", f"must be kinds of {rm_lib.KINDS} including {learned}, got {tuple(m.train)}")
  sizes = ("train_prompts", "test_prompts", "sample_batch", "steps", "batch_size", "max_len", "score_batch")
  for n, v in [(n, m[n]) for n in sizes] + [(f"lr.{k}", m.lr.get(k)) for k in m.train]:
    if not (is_number(v) and v > 0):
      config_error(f"reward_model.{n}", f"must be > 0, got {v!r}")
  if m.batch_size > m.train_prompts:
    config_error("reward_model.batch_size", f"{m.batch_size} exceeds the {m.train_prompts} training pairs")
  for n in ("label_tau", "length_penalty"):
    if not m[n] >= 0:
      config_error(f"reward_model.{n}", f"must be >= 0, got {m[n]!r}")
  if not 0 <= m.min_verdict_mass <= 1:
    config_error("reward_model.min_verdict_mass", f"must lie in [0, 1], got {m.min_verdict_mass!r}")
  if "genrm" in m.train and rm_lib.VERDICTS[0] not in symbols(tuple(c.data.get("tokenizer_families", ()))):
    config_error("data.tokenizer_families", f"the GenRM needs its verdict pieces {rm_lib.VERDICTS}: include 'pref'")
