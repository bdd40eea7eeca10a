"""Validation of a whole run config before anything runs: one-line ValueError naming the field."""

from __future__ import annotations

import os

from stepflash_jax import config as model_config_lib
from stepflash_jax.agents import envs
from stepflash_jax.agents.tools import CALL_CLOSE
from stepflash_jax.checks import is_int, is_number
from stepflash_jax.data import tasks
from stepflash_jax.data.tokenizer import DEFAULT_FAMILIES, symbols
from stepflash_jax.optim.muon import PE_SAFETY_SCHEDULES
from stepflash_jax.parallel.mesh import check_rules, mesh_shape
from stepflash_jax.parallel.mesh import config_error as _err
from stepflash_jax.sampling import ENGINE_DTYPES  # numerics of the rollout / eval engine
from stepflash_jax.sampling.quantize import QUANT_FORMATS

OBJECTIVES = ("mispo", "ppo", "gspo", "tis")


REPLAY_MODES = ("off", "always", "auto")  # rl.router_replay (docs/rl.md §8)
RHO_TOKENS = ("all", "kept")  # rl.rho_tokens: the tokens of rho in rl.losses.mis_mask (docs/rl.md §2)


def _mixture(field, spec):
  try:
    tasks.parse_mixture(spec)
  except (ValueError, KeyError) as e:
    _err(field, str(e))


def _positive(c, section, names):
  for n in names:
    v = c[section][n]
    if not (is_number(v) and v > 0):
      _err(f"{section}.{n}", f"must be > 0, got {v!r}")


JOBS = ("pretrain", "sft", "rl", "pipeline")


MINIBATCHES = ("actor_minibatches", "critic_minibatches")


def resolve_pack(c, num_devices: int) -> str:
  """Sequence packing (rl.pack, a default of configs/mispo.py) runs a packed batch as one model pass on one device:
  with rl.micro_batch > 0 or a mesh of several devices it is turned off here (rl.pack = 0). Returns a note saying
  so, or "" when nothing changed. An invalid mesh is left for validate_run_config to name."""
  pack = c.get("rl", {}).get("pack", 0.0)
  if not pack or isinstance(pack, bool):
    return ""
  try:
    sizes = mesh_shape(c.mesh, num_devices)
  except ValueError:
    return ""
  why = [f"rl.micro_batch={c.rl.micro_batch}"] if c.rl.get("micro_batch", 0) else []
  why += [f"a mesh of {num_devices} devices"] if any(v > 1 for v in sizes.values()) else []
  if not why:
    return ""
  c.rl.pack = 0.0
  return f"rl.pack {pack} -> 0: a packed batch is one model pass on one device, and this run has {' and '.join(why)}"


def validate_run_config(c, num_devices: int | None = None) -> None:
  if c.get("job") not in JOBS:
    _err("job", f"must be one of {JOBS}, got {c.get('job')!r}")
  try:
    model_config_lib.validate(c.model)
  except ValueError as e:
    raise ValueError(str(e).replace("model config field '", "config field 'model.")) from None
  _positive(c, "data", ["batch_size", "seq_len", "max_prompt_len"])
  _mixture("data.mixture", c.data.mixture)
  _positive(c, "optim", ["lr"])
  if not 0 <= c.optim.warmup_frac < 1:
    _err("optim.warmup_frac", f"must be in [0, 1), got {c.optim.warmup_frac}")
  if c.optim.weight_decay < 0:
    _err("optim.weight_decay", f"must be >= 0, got {c.optim.weight_decay}")
  if c.optim.muon_method not in ("polar_express", "newton_schulz"):
    _err("optim.muon_method", f"unknown method {c.optim.muon_method!r}")
  if c.optim.ortho_dtype not in ("float16", "float32", "bfloat16"):
    _err("optim.ortho_dtype", f"unknown dtype {c.optim.ortho_dtype!r}")
  if c.optim.get("pe_safety", "reference") not in PE_SAFETY_SCHEDULES:
    _err("optim.pe_safety", f"must be one of {PE_SAFETY_SCHEDULES}, got {c.optim.pe_safety!r}")
  if c.data.get("jsonl") and not os.path.isfile(c.data.jsonl):
    _err("data.jsonl", f"{c.data.jsonl!r} is not a file")
  if c.model.get("hf_dir") and c.train.steps == 0:  # RL straight from the checkpoint: no SFT stage
    _positive(c, "train", ["log_every", "eval_every", "checkpoint_every", "keep_checkpoints"])
  else:
    _positive(c, "train", ["steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints"])
  if c.train.mtp_weight < 0:
    _err("train.mtp_weight", f"must be >= 0, got {c.train.mtp_weight}")
  if c.train.mtp_weight > 0 and c.model.num_mtp_layers == 0:
    _err("train.mtp_weight", "is > 0 but the model has no MTP modules (model.num_mtp_layers = 0)")
  if c.train.get("ep_balance_coef", 0) > 0 and c.model.num_experts % c.train.ep_groups:
    _err("train.ep_groups", f"{c.train.ep_groups} does not divide model.num_experts={c.model.num_experts}")
  _check_pretrain_stage(c, num_devices)
  _positive(c, "eval", ["num_examples", "batch_size", "max_new_tokens"])
  if c.data.max_prompt_len + c.eval.max_new_tokens > c.model.max_position_embeddings:
    _err("eval.max_new_tokens", "prompt + response exceed model.max_position_embeddings")
  if c.eval.get("dtype", "float32") not in ENGINE_DTYPES:
    _err("eval.dtype", f"must be one of {ENGINE_DTYPES}, got {c.eval.dtype!r}")
  if "rl" in c:
    _check_rl(c)
  _check_agent(c)
  if num_devices is not None:
    sizes = mesh_shape(c.mesh, num_devices)
    if c.model.num_experts % sizes["expert"]:
      _err("mesh.expert", f"{sizes['expert']} does not divide model.num_experts={c.model.num_experts}")
    if "rl" in c and c.rl.get("pack", 0.0) and any(v > 1 for v in sizes.values()):
      _err("rl.pack", f"packing runs on one device (its rows are not laid out for a mesh), not a mesh of {sizes}")
  if "rules" in c.mesh:
    check_rules(tuple(tuple(r) for r in c.mesh.rules))


def _check_agent(c):
  """data.tokenizer_families and the `agent` section (multi-turn tool use, agents/rollout.py)."""
  families = tuple(c.data.get("tokenizer_families", DEFAULT_FAMILIES))
  for f in families:
    if f not in tasks.families():
      _err("data.tokenizer_families", f"unknown task family {f!r}; registered: {tasks.families()}")
  if "agent" not in c:
    return
  a = c.agent
  if c.model.get("hf_dir"):
    _err("model.hf_dir", "agent runs use the project's own chat format (SentencePiece tokenizer), not a checkpoint's")
  if a.env not in envs.ENVIRONMENTS:
    _err("agent.env", f"must be one of {sorted(envs.ENVIRONMENTS)}, got {a.env!r}")
  for n in ("max_turns", "turn_tokens", "workers"):
    if not is_int(a[n]) or a[n] < 1:
      _err(f"agent.{n}", f"must be an int >= 1, got {a[n]!r}")
  if a.executor not in ("local", "ray"):
    _err("agent.executor", f"must be 'local' or 'ray', got {a.executor!r}")
  if CALL_CLOSE not in symbols(families):
    _err("data.tokenizer_families", f"must include a tool-use family (e.g. toolmul) for the agent, got {families}")
  if "rl" in c and (c.rl.router_replay != "off" or c.rl.get("rollout_slots", 0)):
    _err("rl.router_replay", "multi-turn rollouts (agent) need router_replay 'off' and rollout_slots 0")


def _check_rl(c):
  """The `rl` section: objective, sizes and their divisibility, batching, filters, engines, schedules."""
  r = c.rl
  if r.objective not in OBJECTIVES:
    _err("rl.objective", f"must be one of {OBJECTIVES}, got {r.objective!r}")
  if r.get("mixture"):
    _mixture("rl.mixture", r.mixture)
  _positive(
    c,
    "rl",
    [
      "steps",
      "prompts_per_step",
      "samples_per_prompt",
      "max_new_tokens",
      "actor_lr",
      "critic_lr",
      "actor_minibatches",
      "critic_minibatches",
      "ppo_clip",
      "gspo_clip",
      "tis_cap",
    ],
  )
  n = r.prompts_per_step * r.samples_per_prompt
  for k in MINIBATCHES:
    if n % r[k]:
      _err(f"rl.{k}", f"{r[k]} does not divide the generation's {n} responses")
  slots = r.get("rollout_slots", 0)
  if not is_int(slots) or not 0 <= slots <= n:
    _err(
      "rl.rollout_slots",
      f"must be an integer in [0, {n}] (0 = static batching; at most the {n} responses), got {slots!r}",
    )
  if not is_int(over := r.get("oversample", 1)) or over < 1:
    _err("rl.oversample", f"must be an integer >= 1 (prompts sampled per prompt trained; 1 = all), got {over!r}")
  micro = r.get("micro_batch", 0)
  if not is_int(micro) or micro < 0:
    _err("rl.micro_batch", f"must be an integer >= 0 (rows per model pass; 0 = the whole batch), got {micro!r}")
  for rows, what in [(n, "generation")] + [(n // r[k], f"mini-batches of rl.{k}={r[k]}") for k in MINIBATCHES]:
    if micro and rows > micro and rows % micro:  # a batch no larger than micro_batch is one pass
      _err("rl.micro_batch", f"{micro} does not divide the {rows}-row {what}")
  pack = r.get("pack", 0.0)
  if not (is_number(pack) and 0 <= pack <= 1):
    _err(
      "rl.pack", f"must be a number in [0, 1] (packed rows as a fraction of the unpacked slots; 0 = off), got {pack!r}"
    )
  if pack and micro:
    _err("rl.pack", f"packed batches run as one model pass: needs rl.micro_batch 0, got {micro}")
  stale = r.get("max_staleness", 0)
  if not is_int(stale) or stale < 0:
    _err("rl.max_staleness", f"must be an integer >= 0 (generations between sampling and training), got {stale!r}")
  if not isinstance(r.get("async", False), bool):
    _err("rl.async", f"must be True or False, got {r['async']!r}")
  if r.get("async", False) and stale < 1:
    _err("rl.async", "overlapped generation samples generation j + 1 while j trains: needs rl.max_staleness >= 1")
  for name in ("token_bounds", "traj_bounds"):
    b = r[name]
    pair = isinstance(b, (tuple, list)) and len(b) == 2 and all(is_number(x) for x in b)
    if not (pair and 0 < b[0] <= 1 <= b[1]):
      _err(f"rl.{name}", f"need a pair (low, high) with 0 < low <= 1 <= high, got {b!r}")
  if r.truncation not in ("bootstrap", "zero", "task"):
    _err("rl.truncation", f"must be 'bootstrap', 'zero' or 'task', got {r.truncation!r}")
  if r.rollout_dtype not in ENGINE_DTYPES:
    _err("rl.rollout_dtype", f"must be one of {ENGINE_DTYPES}, got {r.rollout_dtype!r}")
  if not 0 < r.top_p <= 1:
    _err("rl.top_p", f"must be in (0, 1], got {r.top_p}")
  if r.temperature <= 0:
    _err("rl.temperature", f"must be > 0, got {r.temperature}")
  if r.get("normalizer", "valid") not in ("valid", "kept"):
    _err("rl.normalizer", f"must be 'valid' or 'kept' (used by every objective), got {r.normalizer!r}")
  if r.get("rho_tokens", "all") not in RHO_TOKENS:
    _err("rl.rho_tokens", f"must be one of {RHO_TOKENS} (the tokens MIS-PO's rho averages over), got {r.rho_tokens!r}")
  if r.get("rollout_quantize", "none") not in ("none", *QUANT_FORMATS):
    _err("rl.rollout_quantize", f"must be 'none' or one of {tuple(QUANT_FORMATS)}, got {r.rollout_quantize!r}")
  if r.get("router_replay", "off") not in REPLAY_MODES:
    _err("rl.router_replay", f"must be one of {REPLAY_MODES}, got {r.router_replay!r}")
  if not 0 <= r.get("replay_threshold", 0.0) <= 1:
    _err("rl.replay_threshold", f"must lie in [0, 1] (a routing confidence), got {r.replay_threshold}")
  kl_start = r.get("kl_start", 0)
  if not is_int(kl_start) or kl_start < 0:
    _err("rl.kl_start", f"must be an integer generation index >= 0, got {kl_start!r}")


def _check_pretrain_stage(c, num_devices):
  """An SFT (or RL) config's optional `pretrain` section: a whole pre-training job on the same model."""
  if "pretrain" not in c:
    if c.train.get("init_from"):
      _err("train.init_from", "is set but the config has no pretrain section (e.g. configs/sft.py:pretrained)")
    return
  if c.job == "pretrain":
    _err("pretrain", "a pre-training job cannot have a pretrain stage of its own")
  try:
    validate_run_config(c.pretrain, num_devices)
  except ValueError as e:
    raise ValueError(str(e).replace("config field '", "config field 'pretrain.")) from None
  if c.pretrain.job != "pretrain":
    _err("pretrain.job", f"must be 'pretrain', got {c.pretrain.job!r}")
  if c.pretrain.model.to_dict() != c.model.to_dict():
    _err("pretrain.model", "must equal 'model' (SFT starts from the pre-trained weights)")
