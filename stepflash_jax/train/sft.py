"""Next-token training: SFT (docs/training.md §2) and pre-training (§3): next-token + MTP loss, Muon, warmup + cosine.

  loss = CE(main head, next token) + mtp_weight * mean_k CE(MTP module k, token t+k+2)     (all CE in fp32)

Each CE is averaged over the assistant tokens of the batch (loss_mask), never across packed documents
(segment ids reach the attention). One jitted step: grads -> global-norm clip 1.0 -> Muon/AdamW; a step with
a non-finite loss or gradient is skipped (params, router bias and optimizer state unchanged) and reported as
`skipped=1`. Every step logs the routing statistics per MoE layer (`moe.routing_metrics`).

job "sft": chat-formatted examples, loss on the assistant's tokens, router frozen (config.train.freeze_router), held-out
accuracy. job "pretrain": the same examples as plain text, loss on every token, router trained with aux-loss-free
bias balancing and the EP-group balance loss; no accuracy eval (the model has not seen the chat format).
An SFT config with a `pretrain` section starts from that pre-training run (trained first, or reused when finished)
in `train.init_from` ("" = <workdir>/pretrain).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from stepflash_jax import config as config_lib
from stepflash_jax import hf
from stepflash_jax import model as model_lib
from stepflash_jax import parallel
from stepflash_jax.train import state as state_lib
from stepflash_jax.data import future_targets, jsonl, sft_dataset
from stepflash_jax.data.hf_tokenizer import tokenizer_for
from stepflash_jax.model.moe import ep_balance_loss, routing_metrics, update_router_bias
from stepflash_jax.train import evaluate
from stepflash_jax.train.checkpoint import Checkpointer
from stepflash_jax.train.metrics import MetricsWriter, Progress, plot_metrics
from stepflash_jax.train.step import due, frozen_mask, guarded_update, lr_schedule, make_optimizer


def token_ce(head, targets, mask):
  """Sum over masked positions of -log softmax(logits)[target] (fp32) and the mask count; head = (normed hidden,
  head weight), the logits never materialised (`model.head_logprobs`)."""
  logp = model_lib.head_logprobs(head, targets)[0]
  return -jnp.sum(logp * mask), jnp.sum(mask)


def sft_loss(params, router, batch, args, mtp_weight: float, ep_coef: float = 0.0, ep_groups: int = 1):
  out, stats = model_lib.apply(
    args,
    {"params": params, "router": router},
    batch["tokens"],
    positions=batch["positions"],
    segment_ids=batch["segment_ids"],
    mtp=mtp_weight > 0,
    stats=True,
    logits=False,
  )
  s, n = token_ce(out["heads"][0], batch["targets"], batch["loss_mask"])
  main = s / jnp.maximum(n, 1.0)
  metrics = {"loss": main, "tokens": n}
  total = main
  if mtp_weight > 0:
    mtp = []
    for k, head in enumerate(out["heads"][1:]):
      t, m = future_targets(batch["targets"], batch["loss_mask"], batch["segment_ids"], k + 1)
      sk, nk = token_ce(head, t, m)
      mtp.append(sk / jnp.maximum(nk, 1.0))
      metrics[f"mtp{k + 1}_loss"] = mtp[-1]
    total = total + mtp_weight * jnp.mean(jnp.stack(mtp))
  if ep_coef > 0:
    metrics["ep_loss"] = ep_balance_loss(stats, ep_groups, args.top_k)
    total = total + ep_coef * metrics["ep_loss"]
  return total, (metrics, stats)


def make_train_step(args, tx, tcfg, lr_fn, mask):
  @jax.jit
  def step(state, batch):
    grad_fn = jax.value_and_grad(sft_loss, has_aux=True)
    (loss, (metrics, stats)), grads = grad_fn(
      state["params"], state["router"], batch, args, tcfg.mtp_weight, tcfg.ep_balance_coef, tcfg.ep_groups
    )
    params, opt, gnorm, skipped = guarded_update(state, grads, loss, tx, mask)
    router = state["router"]
    if tcfg.router_bias_rate > 0:
      new = update_router_bias(router, stats, tcfg.router_bias_rate)
      router = jax.tree.map(lambda a, b: jnp.where(skipped > 0, b, a), new, router)
    metrics.update(total_loss=loss, grad_norm=gnorm, skipped=skipped, lr=lr_fn(state["step"]))
    metrics.update(routing_metrics(stats, router))
    return {**state, "params": params, "opt": opt, "router": router, "step": state["step"] + 1}, metrics

  return step


def train(config, workdir: str, log=print, examples=None, reuse=None):
  """Run (or resume) SFT or pre-training (config.job) into workdir on the mesh of config.mesh; returns
  {"variables", "accuracy" (None for pre-training), "step", "tokenizer"}. A finished run is restored, not retrained.
  With model.hf_dir the model, its weights and its tokenizer come from that checkpoint (hf.resolve_model).
  `examples` (a list of example dicts, e.g. distilled data) replaces the training data of config.data.
  `reuse`: the config field that pointed at workdir (e.g. "rl.sft_workdir") when it is another run reused as a
  starting point: its recorded length must then equal train.steps (it is resumed, never extended or cut)."""
  config = hf.resolve_model(config)
  mesh, rules = parallel.make_mesh(config.mesh), parallel.rules(config)
  with parallel.use_mesh(mesh, rules):
    return _train(config, workdir, log, mesh, rules, examples, reuse)


def finished(workdir: str, steps: int) -> bool:
  """Whether the run in workdir has a checkpoint at `steps` or later: `train` would restore it, not train."""
  ckpts = _checkpoint_dir(workdir)
  return os.path.isdir(ckpts) and (Checkpointer(ckpts, read_only=True).latest_step() or 0) >= steps


def _checkpoint_dir(workdir: str) -> str:
  return os.path.join(workdir, "checkpoints")


def _start_variables(config, workdir, log, mesh, rules):
  """The SFT stage's starting point: the pre-training run of config.pretrain (run or resumed there first), else
  a fresh init from config.seed, or the weights of model.hf_dir."""
  if config.model.hf_dir:
    log(f"sft: starting from the checkpoint in {config.model.hf_dir}")
    keep = {k: config.model[k] for k in config_lib.IMPL_KEYS + ("param_dtype",)}
    variables = hf.load_hf_checkpoint(config.model.hf_dir, **keep)[1]
    return state_lib.place_state(variables, model_lib.as_args(config.model), mesh, rules)
  if config.get("pretrain") is None:
    return state_lib.init_variables(model_lib.as_args(config.model), jax.random.key(config.seed), mesh, rules)
  pre_dir = config.train.get("init_from") or os.path.join(workdir, "pretrain")
  log(f"sft: starting from the pre-training run in {pre_dir}")
  return _train(config.pretrain, pre_dir, log, mesh, rules, reuse="train.init_from")["variables"]


def _check_reuse(extra, steps, workdir, stage, reuse, field):
  """A reused run (train(reuse=...)) trains on only under the length it was started with: another length would
  change its schedule and its checkpoints, which other runs may be using (ConfigError naming both fields)."""
  recorded = extra.get("steps")
  if reuse and recorded is not None and recorded != steps:
    raise config_lib.ConfigError(
      f"config field '{field}': {steps}, but the {stage} run in {workdir} (named by '{reuse}') was started with "
      f"{recorded} steps; a reused run is never extended or cut: set {field}={recorded} or name a new directory"
    )


def _dataset(config, tok, log, pretrain: bool, examples=None):
  """The stage's batches: raw text (pre-training) or chat documents (SFT) of the config's mixture, or `examples`."""
  if examples is None and config.train.steps:
    examples = jsonl.config_examples(config, tok, "train", log, require_response=True)
  return sft_dataset(
    tok,
    batch_size=parallel.local_batch_size(config.data.batch_size),
    seq_len=config.data.seq_len,
    mixture=config.data.mixture,
    seed=config.seed,
    form="text" if pretrain else "chat",
    examples=examples,
  )


def _train(config, workdir, log, mesh, rules, examples=None, reuse=None):
  os.makedirs(workdir, exist_ok=True)
  args = model_lib.as_args(config.model)
  t = config.train
  stage = "pretrain" if config.job == "pretrain" else "sft"  # an RL config's SFT stage has job "rl"
  pretrain = stage == "pretrain"
  tok = tokenizer_for(config)
  it = iter(_dataset(config, tok, log, pretrain, examples))
  lr_fn = lr_schedule(config.optim.lr, t.steps, config.optim.warmup_frac, config.optim.end_lr_frac)
  tx = make_optimizer(config.optim, lr_fn)
  ckpt = Checkpointer(_checkpoint_dir(workdir), max_to_keep=t.keep_checkpoints)
  start = ckpt.latest_step()
  if start is None:
    variables = _start_variables(config, workdir, log, mesh, rules)  # created sharded
  else:  # the shapes to restore into
    variables = state_lib.init_variables(args, jax.random.key(config.seed), mesh, rules)
  state = {
    "params": variables["params"],
    "router": variables["router"],
    "opt": state_lib.init_opt_state(tx, variables["params"], args, mesh, rules),
    "step": jnp.int32(0),
  }
  if start is not None:
    state, extra = ckpt.restore(start, target=state)
    _check_reuse(extra, t.steps, workdir, stage, reuse, "pretrain.train.steps" if pretrain else "train.steps")
    if start < t.steps:  # (a finished run may be reused with another data pipeline, e.g. by the RL stage)
      it.set_state(extra["data"])
    log(f"{stage}: resumed from step {start} in {workdir}")
  start = start or 0
  restored_finished = start >= t.steps
  writer = MetricsWriter(workdir, stage, resume_step=start)
  step_fn = make_train_step(
    args, tx, t, lr_fn, frozen_mask(state["params"], t.freeze_router, t.get("router_lr_scale", 1.0))
  )
  eval_set = None if pretrain else evaluate.heldout_examples(config, tok)
  keys = ["loss", "mtp1_loss", "grad_norm", "lr"] + (
    ["routing/confidence", "routing/load_imbalance"] if pretrain else []
  )
  prog = Progress(t.steps, every=t.log_every, desc=stage, keys=keys, start_step=start)
  acc = None
  for step in range(start, t.steps):
    batch = parallel.shard_batch(next(it), mesh, rules)
    state, metrics = step_fn(state, batch)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}  # one transfer for all scalars
    if metrics["skipped"]:
      log(f"{stage}: step {step + 1} skipped (non-finite loss or gradient)")
    if eval_set is not None and due(step + 1, t.eval_every, t.steps):
      acc = evaluate.accuracy(config, {"params": state["params"], "router": state["router"]}, tok, eval_set)
      metrics.update({f"eval/{k}": v for k, v in acc.items()})
    writer.write(step + 1, metrics)
    prog.update(step + 1, metrics)
    if due(step + 1, t.checkpoint_every, t.steps):
      ckpt.save(step + 1, state, {"data": it.get_state(), "steps": t.steps}, force=True)
  writer.close()
  ckpt.wait()
  shown = ["routing/confidence", "routing/load_imbalance", "routing/bias_norm"] if pretrain else ["eval/accuracy"]
  jsonl_path, png_path = (os.path.join(workdir, f) for f in (f"metrics_{stage}.jsonl", f"{stage}.png"))
  plot_metrics(jsonl_path, ["loss", "mtp1_loss", "grad_norm", "lr"] + shown, png_path, title=stage)
  variables = {"params": state["params"], "router": state["router"]}
  if acc is None and eval_set is not None:  # resumed after the last step: evaluate the restored state
    acc = evaluate.accuracy(config, variables, tok, eval_set)
  hf_dir = os.path.join(workdir, "hf")
  # (no SFT steps: the input checkpoint itself, not copied). A finished run that is only restored (an RL stage
  # reusing it, possibly several side by side) keeps its export.
  if not pretrain and t.steps and not (restored_finished and os.path.isdir(hf_dir)):
    hf.export(config.model, variables, tok, hf_dir)
  return {
    "variables": variables,
    "accuracy": acc,
    "step": int(state["step"]),
    "tokenizer": tok,
  }
