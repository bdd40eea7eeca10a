"""Pod plan by simulation: per-device memory of SFT and RL for a mesh, from abstract shapes only (no allocation).

  python experiments/plan_pod.py --config=configs/model/step35_flash.py --mesh=data:1,fsdp:16,expert:16,tensor:1
  python experiments/plan_pod.py --config=configs/model/step35_flash.py --sweep        # the hardware table
  python experiments/plan_pod.py --config=configs/model/step35_flash.py --context_table --seq_len=131072

What is exact and what is estimated:
  * params / optimizer state / gradients: exact bytes per device. Shapes from jax.eval_shape of the model and of
    the real optimizer's init (Muon momentum fp32, AdamW mu + nu fp32, counters); every leaf sharded by the rules
    table (stepflash_jax.parallel: the same resolution the training code uses), per-device shard = ceil(dim /
    product of its mesh axes). Gradients have the parameters' shapes and dtype.
  * activations: analytic, bytes of the tensors the backward pass keeps per token (see `layer_bytes`), times the
    tokens per device = ceil(rows / batch shards) * sequence length. Attention is assumed flash-style
    (attention_impl="pallas": only O and the log-sum-exp are kept; the "xla" path would also keep the band of
    scores). remat "none": every layer keeps everything; "block" (model remat=True, what the code does): the
    scanned blocks keep only their input and one block is recomputed at a time, unrolled layers and MTP keep
    everything; "full": as "block" but every layer rematerialised (not implemented in the model: what it would
    give). With mesh context n every device holds T / n positions of its rows. Logits: never [tokens, V] at
    once (ops/logprobs.py, vocabulary-chunked): 12 fp32 bytes per token and head (log-prob, log-sum-exp,
    entropy) plus one [tokens, chunk] block of logits, softmax and gradient.
  * RL: static = actor (params + optimizer) + critic (params + optimizer) + frozen reference params (+ the
    actors of the queued rollouts with rl.async: --rl_max_staleness copies); on top the largest phase: rollout
    (KV cache of all rows + prefill logits), scoring (forward over one micro-batch; the whole generation without
    micro-batches), actor update (gradients + accumulator + activations of one micro-batch, no MTP) or critic
    update (the same, no logits). For each mesh the sweep also says how many rows per device and pass
    (rl.micro_batch / batch shards) let the whole recipe fit: the answer to "can this slice run it".
  * context parallelism (--context_table): the bytes each device sends per step for attention, per layer type
    (parallel/context.py `exchange_bytes`, checked against compiled programs by tests/test_context_parallel.py).
Not modelled: XLA temporaries/fragmentation (keep ~10-15% headroom), the compiled program, host offload.
"""

from __future__ import annotations

import functools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from stepflash_jax import model as model_lib
from stepflash_jax import parallel
from stepflash_jax.parallel import context as context_lib
from stepflash_jax.train import state as state_lib
from stepflash_jax.ops.logprobs import DEFAULT_CHUNK
from stepflash_jax.optim import muon

GiB = 2**30
_CONFIG = config_flags.DEFINE_config_file("config", "configs/model/step35_flash.py", "model config file")
_MESH = flags.DEFINE_string("mesh", "data:1,fsdp:16,expert:16,tensor:1", "axis sizes data/fsdp/expert/context/tensor")
_BATCH = flags.DEFINE_integer("batch", 32, "SFT global batch (sequences)")
_SEQ = flags.DEFINE_integer("seq_len", 8192, "SFT sequence length")
_REMAT = flags.DEFINE_enum("remat", "block", ["none", "block", "full"], "activation rematerialisation")
_PROMPTS = flags.DEFINE_integer("rl_prompts", 256, "RL prompts per generation")
_SAMPLES = flags.DEFINE_integer("rl_samples", 16, "RL responses per prompt")
_PLEN = flags.DEFINE_integer("rl_prompt_len", 2048, "RL prompt length")
_RLEN = flags.DEFINE_integer("rl_response_len", 16384, "RL response length (max_new_tokens)")
_AMB = flags.DEFINE_integer("actor_minibatches", 4, "actor mini-batches per generation")
_CMB = flags.DEFINE_integer("critic_minibatches", 12, "critic mini-batches per generation")
_ROLL_DTYPE = flags.DEFINE_enum("rollout_dtype", "bfloat16", ["bfloat16", "float32"], "rollout engine dtype")
_HBM = flags.DEFINE_float("hbm_gib", 95.0, "HBM per device in GiB (v5p: 95, H200: 141 GB = 131.3 GiB)")
_CF = flags.DEFINE_float("capacity_factor", 1.0, "MoE rows per device relative to a perfectly balanced load")
_MICRO = flags.DEFINE_integer(
  "micro_rows",
  0,
  "RL: rows per device per forward/backward pass with gradient accumulation (rl.micro_batch divided by the "
  "batch shards; 0 = each batch in one pass)",
)
_STALE = flags.DEFINE_integer("rl_max_staleness", 0, "RL: rl.max_staleness (actors kept for queued rollouts)")
_SWEEP = flags.DEFINE_bool("sweep", False, "print the hardware x mesh table instead of one plan")
_CONTEXT_TABLE = flags.DEFINE_bool(
  "context_table", False, "print the attention exchange per step for context 2..16 at --seq_len (tensor from --mesh)"
)


# ---------------------------------------------------------------------------------------------------------------
# Exact: variables and optimizer state


def parse_mesh(text: str) -> dict:
  sizes = dict(data=1, fsdp=1, expert=1, context=1, tensor=1)
  for part in text.split(","):
    k, _, v = part.partition(":")
    if k.strip() not in sizes:
      raise ValueError(f"--mesh: unknown axis {k!r} in {text!r}; axes are {tuple(sizes)}")
    sizes[k.strip()] = int(v)
  return sizes


def shard_bytes(x, spec, sizes) -> int:
  n = 1
  for d, axes in zip(x.shape, tuple(spec) + (None,) * (len(x.shape) - len(spec))):
    axes = () if axes is None else ((axes,) if isinstance(axes, str) else axes)
    n *= -(-d // math.prod(sizes[a] for a in axes))
  return n * np.dtype(x.dtype).itemsize


def tree_bytes(tree, specs, sizes) -> int:
  return sum(
    shard_bytes(x, s, sizes)
    for x, s in zip(
      jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    )
  )


@functools.lru_cache(maxsize=8)
def _abstract(args, head):
  """(variables, optimizer state) as ShapeDtypeStructs: the model and the real optimizer (Muon + AdamW)."""
  shapes = model_lib.abstract_variables(args, head)
  return shapes, jax.eval_shape(muon(1e-5, grad_clip_norm=1.0).init, shapes["params"])


def static_bytes(args, sizes, rules, head: str, dropped: list) -> dict:
  """Per-device bytes of {"params", "router", "opt", "grads", "muon_transient"} for one model head.
  muon_transient: 4 fp32 copies of the largest local parameter shard (gradient, Nesterov sum, iterate, Gram)."""
  shapes, opt = _abstract(args, head)
  specs = state_lib.variable_specs(args, sizes, rules, head, dropped)
  opt_specs = state_lib.state_specs(opt, args, sizes, rules)
  p = tree_bytes(shapes["params"], specs["params"], sizes)
  largest = max(
    shard_bytes(x, s, sizes) // np.dtype(x.dtype).itemsize * 4
    for x, s in zip(
      jax.tree.leaves(shapes["params"]),
      jax.tree.leaves(specs["params"], is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)),
    )
  )
  return {
    "params": p,
    "router": tree_bytes(shapes["router"], specs["router"], sizes),
    "opt": tree_bytes(opt, opt_specs, sizes),
    "grads": p,
    "muon_transient": 4 * largest,
  }


# ---------------------------------------------------------------------------------------------------------------
# Analytic: activations


def layer_bytes(args, spec, t: int, cf: float) -> float:
  """Bytes kept for the backward pass per token by one decoder layer (tensor parallel t splits heads and mlp).

  attention: residual + normed input (2H), q/k/v projections (kept for the QK-norm backward) and q/k after
    norm + RoPE, the attention output and the gated output (o_proj input): a * (2H + (3Hq + 4Hkv) D / t) bytes,
    plus the fp32 gate logits and log-sum-exp (8 Hq / t).
  dense FFN: residual + normed (2H a), fp32 gate/up (8 I / t), activation (a I / t).
  MoE: residual + normed (2H a), fp32 router logits + scores (8E), per token k routed rows (input rows a kH,
    fp32 gate/up 8kF/t, activation a kF/t, outputs a kH, fp32 outputs 4kH) times the capacity factor, the shared
    expert as a dense FFN of width S.
  """
  a = np.dtype(args.dtype).itemsize
  H, D, Hq, Hkv = args.hidden_size, args.head_dim, spec.num_heads, args.num_kv_heads
  attn = a * (2 * H + (3 * Hq + 4 * Hkv) * D / t) + 8 * Hq / t
  if spec.moe:
    k, F, S, E = args.top_k, args.moe_intermediate_size, args.shared_intermediate_size, args.num_experts
    ffn = a * 2 * H + 8 * E + cf * k * (a * H + 8 * F / t + a * F / t + a * H + 4 * H) + 8 * S / t + a * S / t
  else:
    I = args.intermediate_size
    ffn = a * 2 * H + 8 * I / t + a * I / t
  return attn + ffn


def activation_bytes(args, tokens: float, sizes, remat: str, cf: float, mtp: bool, logits: bool) -> dict:
  """Per-device activation bytes of one training step over `tokens` tokens on this device."""
  t = sizes["tensor"]
  a = np.dtype(args.dtype).itemsize
  H = args.hidden_size
  start, period, n = args.scan if args.scan else (len(args.layers), 0, 0)
  scanned = set(range(start, start + period * n))
  per = [layer_bytes(args, s, t, cf) for s in args.layers]
  unrolled = sum(p for i, p in enumerate(per) if i not in scanned)
  block = sum(per[start : start + period]) if n else 0.0
  if remat == "none":
    layers = sum(per)
  elif remat == "block":
    layers = unrolled + n * a * H + block
  else:  # every layer rematerialised
    layers = len(per) * a * H + max(per)
  heads = 1 + (len(args.mtp_layers) if mtp else 0)
  mtp_layers = sum(a * 5 * H + layer_bytes(args, s, t, cf) for s in args.mtp_layers) if mtp else 0.0
  logit = heads * 12 if logits else 0.0  # fp32 log-prob, log-sum-exp, entropy per token and head
  return {"layers": tokens * layers, "mtp": tokens * mtp_layers, "logits": tokens * logit}


def chunk_bytes(args, tokens: float, sizes) -> float:
  """The vocabulary-chunked log-probs' transient: fp32 logits, softmax and gradient of one chunk of columns."""
  return tokens * min(args.vocab_size, DEFAULT_CHUNK) * 12 / sizes["tensor"]


def kv_cache_bytes(args, rows: float, length: int, sizes, dtype: str) -> float:
  """KV cache of the rollout engine on one device: full layers keep `length` columns, SWA ones the window."""
  a = np.dtype(dtype).itemsize
  hkv = args.num_kv_heads / (sizes["tensor"] if args.num_kv_heads % sizes["tensor"] == 0 else 1)
  total = 0.0
  for s in args.layers:
    S = length if s.window is None else min(length, s.window)
    total += rows * S * (2 * hkv * args.head_dim * a + 4)
  return total


# ---------------------------------------------------------------------------------------------------------------


def rows_per_device(sizes, rows: int) -> int:
  """Rows of a leading batch dimension per device: split over data x fsdp x expert, uneven splits padded
  (GSPMD); mesh.shard_batch places a non-divisible batch over the largest dividing subset instead."""
  return -(-rows // (sizes["data"] * sizes["fsdp"] * sizes["expert"]))


def plan(
  cfg,
  sizes,
  *,
  batch,
  seq_len,
  remat,
  prompts,
  samples,
  prompt_len,
  response_len,
  actor_mb,
  critic_mb,
  rollout_dtype,
  cf,
  hbm_gib,
  micro_rows=0,
  max_staleness=0,
) -> dict:
  """Per-device bytes of SFT and RL on a mesh (see the module docstring); `budget` = 90% of HBM."""
  args = model_lib.as_args(cfg)
  rules = parallel.DEFAULT_RULES
  dropped: list = []
  lm = static_bytes(args, sizes, rules, "lm", dropped)
  value = static_bytes(args, sizes, rules, "value", dropped)
  budget = 0.9 * hbm_gib * GiB
  out = {"devices": math.prod(sizes.values()), "dropped": sorted(set((n, d, a) for n, d, a in dropped))}

  out["sft"] = _sft_plan(args, sizes, lm, batch, seq_len, remat, cf, budget)
  rl = dict(prompt_len=prompt_len, response_len=response_len, actor_mb=actor_mb, critic_mb=critic_mb)
  rl_plan = functools.partial(
    _rl_plan,
    args,
    sizes,
    lm,
    value,
    remat,
    cf,
    budget,
    prompts * samples,
    rollout_dtype,
    max_staleness=max_staleness,
    **rl,
  )
  out["rl"] = rl_plan(micro_rows)
  rows = out["rl"]["rows_per_device"]["actor_mb"]
  halvings = [rows >> i for i in range(rows.bit_length())]  # rows, rows / 2, ..., 1
  out["rl"]["fitting_micro_rows"] = next((m for m in halvings if rl_plan(m)["total"] <= budget), 0)
  return out


def _sft_plan(args, sizes, lm, batch, seq_len, remat, cf, budget) -> dict:
  """SFT: one step over the global batch (MTP heads included)."""
  rows = rows_per_device(sizes, batch)
  sft_tok = activation_bytes(args, 1, sizes, remat, cf, mtp=True, logits=True)
  sft = {
    "params": lm["params"] + lm["router"],
    "opt": lm["opt"],
    "grads": lm["grads"],
    "muon_transient": lm["muon_transient"],
  }
  static = sum(sft.values())
  tokens = rows * seq_len / sizes["context"]
  sft.update({f"act_{k}": v * tokens for k, v in sft_tok.items()})
  sft["logit_chunk"] = chunk_bytes(args, tokens, sizes)
  per_token = sum(sft_tok.values()) + chunk_bytes(args, 1, sizes)
  return {
    "bytes": sft,
    "total": sum(sft.values()),
    "static": static,
    "rows_per_device": rows,
    "act_per_token": per_token,
    "max_tokens": max(0.0, budget - static) / per_token,
  }


def _rl_plan(
  args,
  sizes,
  lm,
  value,
  remat,
  cf,
  budget,
  B,
  rollout_dtype,
  micro_rows,
  *,
  prompt_len,
  response_len,
  actor_mb,
  critic_mb,
  max_staleness=0,
) -> dict:
  """RL: actor + critic + reference (+ queued rollouts' actors) resident; the largest phase on top."""
  t, V = sizes["tensor"], args.vocab_size
  L = prompt_len + response_len
  resident = {
    "actor": lm["params"] + lm["router"] + lm["opt"],
    "critic": value["params"] + value["router"] + value["opt"],
    "reference": lm["params"] + lm["router"],
  }
  if max_staleness:  # rl.async: the actors that sample the queued generations (rl/rollouts.py)
    resident["queued_actors"] = max_staleness * (lm["params"] + lm["router"])
  if np.dtype(args.param_dtype) != np.dtype(rollout_dtype):
    resident["rollout_cast"] = lm["params"] * np.dtype(rollout_dtype).itemsize // np.dtype(args.param_dtype).itemsize
  r_rows, a_rows, c_rows = (
    rows_per_device(sizes, B),
    rows_per_device(sizes, -(-B // actor_mb)),
    rows_per_device(sizes, -(-B // critic_mb)),
  )
  accum = {"lm": 0, "value": 0}
  if micro_rows:  # gradient accumulation: one fp32 accumulator, passes of micro_rows rows
    a_rows, c_rows = min(a_rows, micro_rows), min(c_rows, micro_rows)
    accum = {h: x["grads"] * 4 // np.dtype(args.param_dtype).itemsize for h, x in (("lm", lm), ("value", value))}
  actor_tok = sum(activation_bytes(args, 1, sizes, remat, cf, mtp=False, logits=True).values())
  critic_tok = sum(activation_bytes(args, 1, sizes, remat, cf, mtp=False, logits=False).values())
  layer_max = max(layer_bytes(args, s_, t, cf) for s_ in args.layers)
  s_rows = min(r_rows, micro_rows) if micro_rows else r_rows
  phases = {
    # KV cache of every row + fp32 logits of every prompt position (the engine's prefill computes them all)
    "rollout": kv_cache_bytes(args, r_rows, L, sizes, rollout_dtype) + r_rows * prompt_len * 4 * V / t,
    # logp_old / logp_ref / values: one micro-batch at a time (the whole generation without micro-batches)
    "score": s_rows * L * (layer_max + 12) + chunk_bytes(args, s_rows * L, sizes),
    "actor_update": lm["grads"]
    + accum["lm"]
    + lm["muon_transient"]
    + a_rows * L * actor_tok
    + chunk_bytes(args, a_rows * L, sizes),
    "critic_update": value["grads"] + accum["value"] + value["muon_transient"] + c_rows * L * critic_tok,
  }
  res = sum(resident.values())
  peak = max(phases, key=phases.get)
  return {
    "resident": resident,
    "phases": phases,
    "static": res,
    "peak_phase": peak,
    "total": res + phases[peak],
    "rows_per_device": {"rollout": r_rows, "actor_mb": a_rows, "critic_mb": c_rows},
    "act_per_token": actor_tok,
    "max_tokens": max(0.0, budget - res - lm["grads"] - accum["lm"] - lm["muon_transient"])
    / (actor_tok + chunk_bytes(args, 1, sizes)),
  }


def _g(b) -> str:
  return f"{b / GiB:.1f}"


def print_plan(p, sizes, hbm_gib, kw):
  ok = lambda x: "yes" if x <= 0.9 * hbm_gib * GiB else ("tight (>90% HBM)" if x <= hbm_gib * GiB else "NO")
  print(f"mesh {sizes} ({p['devices']} devices), {hbm_gib:.1f} GiB HBM per device, remat {kw['remat']}")
  if p["dropped"]:
    print("mesh axes dropped for non-divisible dims:", p["dropped"])
  s = p["sft"]
  print(f"\nSFT: batch {kw['batch']} x {kw['seq_len']} tokens -> {s['rows_per_device']} row(s) per device")
  for k, v in s["bytes"].items():
    print(f"  {k:20s}{_g(v):>9s} GiB")
  print(f"  {'total':20s}{_g(s['total']):>9s} GiB   fits: {ok(s['total'])}")
  print(
    f"  activations {s['act_per_token'] / 1024:.0f} KiB/token -> at most {s['max_tokens']:.0f} tokens per device "
    f"per step within 90% HBM"
  )
  r = p["rl"]
  print(
    f"\nRL: {kw['prompts']} x {kw['samples']} responses of {kw['prompt_len']} + {kw['response_len']} tokens, "
    f"rows per device {r['rows_per_device']}"
  )
  for k, v in r["resident"].items():
    print(f"  {k:20s}{_g(v):>9s} GiB   (resident)")
  for k, v in r["phases"].items():
    print(f"  {k:20s}{_g(v):>9s} GiB   (phase{', peak' if k == r['peak_phase'] else ''})")
  print(f"  {'total':20s}{_g(r['total']):>9s} GiB   fits: {ok(r['total'])}")
  print(
    f"  actor update {r['act_per_token'] / 1024:.0f} KiB/token -> at most {r['max_tokens']:.0f} tokens per "
    f"device per update within 90% HBM"
  )
  fit = r["fitting_micro_rows"]
  print(
    f"  the whole recipe fits in 90% HBM with {fit} row(s) per device per pass (rl.micro_batch = {fit} x batch shards)"
    if fit
    else "  the whole recipe does not fit in 90% HBM even with one row per device per pass"
  )


HARDWARE = [  # (name, devices, GiB per device, candidate meshes)
  (
    "v5p-256 = 128 chips",
    128,
    95.0,
    ["fsdp:128", "fsdp:16,expert:8", "fsdp:8,expert:16", "fsdp:4,expert:32", "fsdp:4,expert:8,tensor:4"],
  ),
  ("v5p-512 = 256 chips", 256, 95.0, ["fsdp:16,expert:16", "fsdp:8,expert:32"]),
  ("4 x 8 H200", 32, 141e9 / GiB, ["fsdp:32", "fsdp:4,expert:8", "fsdp:2,expert:8,tensor:2"]),
  ("8 x 8 H200", 64, 141e9 / GiB, ["fsdp:8,expert:8", "fsdp:4,expert:16"]),
  ("16 x 8 H200", 128, 141e9 / GiB, ["fsdp:16,expert:8", "fsdp:8,expert:16"]),
]


def sweep(cfg, kw):
  print(
    f"SFT batch {kw['batch']} x {kw['seq_len']} tokens; RL {kw['prompts']} x {kw['samples']} responses of "
    f"{kw['prompt_len']} + {kw['response_len']} tokens, {kw['actor_mb']} actor / {kw['critic_mb']} critic "
    f"mini-batches, micro_rows {kw['micro_rows'] or 'off'}; remat {kw['remat']}; GiB per device; "
    "max tok = tokens per device per step that fit in 90% HBM after the static part\n"
  )
  print(
    "| hardware | mesh | SFT static | SFT max tok | SFT step (rows/dev) | RL resident | RL max tok (actor) | "
    "RL peak phase | RL total | full RL recipe: rows/dev per pass that fit |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for name, n, hbm, meshes in HARDWARE:
    for m in meshes:
      sizes = parse_mesh(m)
      if math.prod(sizes.values()) != n:
        raise ValueError(f"mesh {m} does not have {n} devices")
      p = plan(cfg, sizes, **kw, hbm_gib=hbm)
      s, r = p["sft"], p["rl"]
      mark = lambda x: "" if x <= 0.9 * hbm * GiB else (" (tight)" if x <= hbm * GiB else " (NO)")
      print(
        f"| {name}, {hbm:.0f} GiB | {m} | {_g(s['static'])} | {s['max_tokens'] / 1024:.0f}K | "
        f"{_g(s['total'])}{mark(s['total'])} ({s['rows_per_device']}) | {_g(r['static'])}{mark(r['static'])} | "
        f"{r['max_tokens'] / 1024:.0f}K | {r['peak_phase']} {_g(r['phases'][r['peak_phase']])} | "
        f"{_g(r['total'])}{mark(r['total'])} | {r['fitting_micro_rows'] or 'none'} |"
      )


def context_table(cfg, seq_len: int, tensor: int):
  """Bytes per device and step (forward + backward, one sequence per device) that attention sends over the
  context axis: the SWA layers' halo against the full layers' ring, for the released layer mix."""
  args = model_lib.as_args(cfg)
  layers = list(args.layers) + list(args.mtp_layers)
  n_swa = sum(s.window is not None and s.window < seq_len for s in layers)
  print(
    f"Attention exchange per device and step at T = {seq_len} (one sequence per device, tensor {tensor}, "
    f"{np.dtype(args.dtype).name} activations): {n_swa} SWA layers, {len(layers) - n_swa} full layers "
    "(MTP included)\n"
  )
  print("| context | positions / device | per SWA layer (halo) | per full layer (ring or all-gather) | step total |")
  print("|---|---|---|---|---|")
  mib = lambda b: f"{b / 2**20:,.1f} MiB"
  for n in (2, 4, 8, 16):
    e = context_lib.exchange_bytes(args, seq_len, n, rows=1, tensor=tensor)
    print(f"| {n} | {seq_len // n:,} | {mib(e['swa_layer'])} | {mib(e['full_layer'])} | {mib(e['step'])} |")


def main(_):
  cfg = _CONFIG.value
  kw = dict(
    batch=_BATCH.value,
    seq_len=_SEQ.value,
    remat=_REMAT.value,
    prompts=_PROMPTS.value,
    samples=_SAMPLES.value,
    prompt_len=_PLEN.value,
    response_len=_RLEN.value,
    actor_mb=_AMB.value,
    critic_mb=_CMB.value,
    rollout_dtype=_ROLL_DTYPE.value,
    cf=_CF.value,
    micro_rows=_MICRO.value,
    max_staleness=_STALE.value,
  )
  if _SWEEP.value:
    sweep(cfg, kw)
    return
  sizes = parse_mesh(_MESH.value)
  if _CONTEXT_TABLE.value:
    context_table(cfg, _SEQ.value, sizes["tensor"])
    return
  print_plan(plan(cfg, sizes, **kw, hbm_gib=_HBM.value), sizes, _HBM.value, kw)


if __name__ == "__main__":
  app.run(main)
