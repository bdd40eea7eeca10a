"""The multi-device half of tests/test_sharding.py, run as ONE subprocess on 8 fake CPU devices.

XLA_FLAGS (device count, fast-compile flags) are set before jax is imported, so the rest of the suite keeps its
single device; the report (JSON on the last stdout line, prefixed "REPORT ") is what the tests assert on.
"""

import json
import os
import sys
import time

if __name__ == "__main__":  # must set the flags before jax is imported
  os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
  )
  os.environ["JAX_PLATFORMS"] = "cpu"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = {
  "data8": dict(data=8, fsdp=1, expert=1, tensor=1),
  "data2_expert4": dict(data=2, fsdp=1, expert=4, tensor=1),
  "fsdp2_expert2_tensor2": dict(data=1, fsdp=2, expert=2, tensor=2),
}


# ---------------------------------------------------------------------------------------------------------------
# Worker (runs in the subprocess)


def small_tiny_config():
  """configs/model/tiny.py (hidden 128, 8 experts top-2, 4/6 query heads over 2 kv heads, vocab 512) cut to two
  layers (full-attention dense, SWA MoE) + one MTP module so that a dozen 8-device compilations fit the budget."""
  sys.path.insert(0, ROOT)
  from stepflash_jax.config import FULL, SWA, load_config_file

  c = load_config_file(os.path.join(ROOT, "configs", "model", "tiny.py"))
  c.update(
    dict(
      num_layers=2,
      num_mtp_layers=1,
      layer_types=[FULL, SWA, SWA],
      rope_theta=[5e6, 1e4, 1e4],
      partial_rotary_factors=[0.5, 1.0, 1.0],
      moe_layers=[1],
      swiglu_limits=[0.0, 7.0, 0.0],
      swiglu_limits_shared=[0.0, 16.0, 0.0],
      expert_parallel="auto",
    )
  )
  return c


def _maxdiff(a, b):
  import jax
  import numpy as np

  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(la, lb))


def _kept(tree, shardings):
  import jax

  return all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def _step_inputs(args, rng):
  """Optimizer, configs, SFT state + batch, actor / critic states and RL mini-batches for the step comparisons."""
  import jax
  import jax.numpy as jnp
  import ml_collections
  import numpy as np
  from stepflash_jax import model as model_lib
  from stepflash_jax.optim import muon
  from stepflash_jax.rl.critic import critic_from_actor
  from stepflash_jax.train import step as step_lib

  # Optimizers: Muon in fp32 (ortho_dtype) and AdamW eps 1e-5. A first AdamW step is lr * g / (|g| + eps): a
  # summation-order difference d of a near-zero gradient moves the entry by lr * d / eps (eps 1e-8: ~1e-4 for
  # d ~ 1e-10; eps 1e-6: 1.5e-5 for the ~5e-9 differences of the lm_head's gradient by vocabulary chunks on 8 shards).
  tx = muon(3e-3, ortho_dtype="float32", adam_eps=1e-5, grad_clip_norm=1.0)
  tcfg = ml_collections.ConfigDict(dict(mtp_weight=0.1, ep_balance_coef=0.0, ep_groups=1, router_bias_rate=1e-3))
  rcfg = ml_collections.ConfigDict(
    dict(objective="mispo", token_bounds=(0.5, 2.0), traj_bounds=(0.996, 1.001), normalizer="valid", kl_coef=1e-3)
  )
  variables = model_lib.init(args, jax.random.key(0))
  mask = step_lib.frozen_mask(variables["params"], True)
  state = {
    "params": variables["params"],
    "router": variables["router"],
    "opt": tx.init(variables["params"]),
    "step": jnp.int32(0),
  }
  critic_vars = critic_from_actor(variables)
  critic_vars["params"]["value_head"]["kernel"] = jnp.asarray(rng.normal(0, 0.1, (128,)), jnp.float32)
  cstate = {"params": critic_vars["params"], "router": critic_vars["router"], "opt": tx.init(critic_vars["params"])}

  # SFT batch: 8 packed rows of 32 tokens, 2 documents per row, padding at the end of one row.
  B, T = 8, 32
  tok = rng.integers(3, 512, (B, T)).astype(np.int32)
  seg = np.ones((B, T), np.int32)
  seg[:, 20:] = 2
  seg[-1, 28:] = 0
  pos = np.concatenate([np.arange(20), np.arange(12)])[None].repeat(B, 0).astype(np.int32)
  batch = dict(
    tokens=tok,
    targets=np.roll(tok, -1, 1),
    loss_mask=(seg > 0).astype(np.float32) * (pos > 3),
    segment_ids=seg,
    positions=pos,
  )
  # RL mini-batch: 8 sequences of prompt 8 + response 8 tokens (the critic's: 4 of them, an uneven batch).
  P, R = 8, 8
  rtok = rng.integers(3, 512, (B, P + R)).astype(np.int32)
  rmask = (np.arange(R)[None] < rng.integers(3, R + 1, (B, 1))).astype(np.float32)
  logp_old = rng.normal(-3.0, 0.5, (B, R)).astype(np.float32)
  mb = dict(
    tokens=rtok,
    positions=np.arange(P + R)[None].repeat(B, 0).astype(np.int32),
    segment_ids=np.concatenate([np.ones((B, P), np.int32), rmask.astype(np.int32)], 1),
    response=rtok[:, P:],
    mask=rmask,
    logp_old=logp_old,
    logp_rollout=logp_old.copy(),
    logp_ref=logp_old + 0.01,
    adv=rng.normal(0, 1, (B, R)).astype(np.float32),
    returns=rng.normal(0, 1, (B, R)).astype(np.float32),
  )
  mb["logp_rollout"][1] -= 0.3  # this trajectory is filtered by MIS-PO
  cmb = {k: v[:4] for k, v in mb.items()}

  return dict(
    tx=tx,
    tcfg=tcfg,
    rcfg=rcfg,
    variables=variables,
    mask=mask,
    state=state,
    cstate=cstate,
    batch=batch,
    mb=mb,
    cmb=cmb,
    P=P,
  )


def _steps_on_meshes(args, rules, x, report):
  """SFT, actor and critic steps on one device and on every mesh of MESHES: losses, states and shardings."""
  import dataclasses
  import jax
  import jax.numpy as jnp
  import numpy as np
  from stepflash_jax import parallel
  from stepflash_jax.rl import programs
  from stepflash_jax.train import sft
  from stepflash_jax.train import state as state_lib

  tx, tcfg, rcfg, mask, state, cstate = x["tx"], x["tcfg"], x["rcfg"], x["mask"], x["state"], x["cstate"]
  batch, mb, cmb, P = x["batch"], x["mb"], x["cmb"], x["P"]

  def run_all(place, a=args):
    """SFT step, actor step, critic step; `place` puts a host pytree on the devices (identity on one device)."""
    step = sft.make_train_step(a, tx, tcfg, lambda s: 3e-3, mask)
    fns = programs.Programs(a, rcfg, tx, tx, P, mask)
    out = {}
    out["sft"] = step(place(state, "state"), place(batch, "batch"))
    out["actor"] = fns.actor_step(
      place({k: state[k] for k in ("params", "router", "opt")}, "state"), place(mb, "batch")
    )
    out["critic"] = fns.critic_step(place(cstate, "state"), place(cmb, "batch"))
    return jax.device_get(out), out

  t = time.time()
  ref, _ = run_all(lambda x, kind: jax.tree.map(jnp.asarray, x))
  report["time_single_device"] = time.time() - t
  for k in ("sft", "actor", "critic"):
    m = ref[k][1]
    report[f"single_{k}"] = {n: float(v) for n, v in m.items() if np.ndim(v) == 0}

  for name, shape in MESHES.items():
    # data 8: the MoE left to GSPMD (expert_parallel "none"); the others: the shard_map path ("auto" = gather here)
    a = dataclasses.replace(args, expert_parallel="none") if name == "data8" else args
    t = time.time()
    mesh = parallel.make_mesh(shape)
    with parallel.use_mesh(mesh, rules):

      def place(x, kind):
        if kind == "batch":
          return parallel.shard_batch(x, mesh, rules)
        return state_lib.place_state(x, args, mesh, rules)

      got, live = run_all(place, a)
      kept = {k: _kept(live[k][0], state_lib.state_shardings(live[k][0], args, mesh, rules)) for k in live}
    r = {"time": time.time() - t, "expert_parallel": a.expert_parallel}
    for k in ("sft", "actor", "critic"):
      loss_key = {"sft": "total_loss", "actor": "actor_loss", "critic": "critic_loss"}[k]
      r[k] = {
        "loss": float(got[k][1][loss_key]),
        "loss_ref": float(ref[k][1][loss_key]),
        "state_maxdiff": _maxdiff(got[k][0], ref[k][0]),
        "metrics_maxdiff": _maxdiff({n: v for n, v in got[k][1].items()}, {n: v for n, v in ref[k][1].items()}),
        "sharding_kept": bool(kept[k]),
      }
    report[name] = r
    print(name, json.dumps(r), file=sys.stderr, flush=True)


def _worker():
  import jax
  import numpy as np
  from stepflash_jax import model as model_lib
  from stepflash_jax import parallel

  assert jax.device_count() == 8
  report, t_start = {}, time.time()
  cfg = small_tiny_config()
  args = model_lib.as_args(cfg)
  rules = parallel.rules(None)
  x = _step_inputs(args, np.random.default_rng(0))
  variables = x["variables"]
  _steps_on_meshes(args, rules, x, report)
  for name, fn in (
    ("ep", _ep_strategies),
    ("attention", _local_attention),
    ("pallas_model", lambda: _pallas_model(cfg)),
    ("muon", lambda: _muon_collectives(args)),
    ("rollout", lambda: _rollout(args, variables, rules)),
    ("init", lambda: _sharded_init(args, variables, rules)),
  ):
    t = time.time()
    report[name] = fn()
    report[f"time_{name}"] = time.time() - t
    print(name, f"{time.time() - t:.1f}s", file=sys.stderr, flush=True)
  report["time_total"] = time.time() - t_start
  print("REPORT " + json.dumps(report))


def _ep_strategies():
  """Each token-exchange strategy on two meshes vs the single-device experts: output and gradients."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from stepflash_jax import parallel
  from stepflash_jax.model.moe import expert_ffn
  from stepflash_jax.model import moe_parallel as ep

  rng = np.random.default_rng(1)
  N, H, E, F, k = 40, 16, 8, 12, 2  # 40 tokens: padded to 48 on the (data 2, expert 4) mesh ...
  x = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)
  ch = np.stack([rng.choice(E, k, replace=False) for _ in range(N)])
  ch[:12] = [0, 1]  # ... and skewed: experts 0/1 (device 0) get 12 extra rows
  ch = jnp.asarray(ch, jnp.int32)
  w = jnp.asarray(rng.random((N, k)), jnp.float32)
  ws = [jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32) for s in ((E, H, F), (E, H, F), (E, F, H))]

  def single(x, wg, wu, wd):
    return jnp.einsum("nkh,nk->nh", expert_ffn(x, ch, wg, wu, wd, 0.5, "xla"), w)

  def value_and_grads(f):
    y, vjp = jax.vjp(f, x, *ws)
    return y, vjp(jnp.cos(y))  # = grad of sum(sin(f))

  y0, g0 = value_and_grads(single)
  out = {}
  # ragged (cf = ep): buffers hold every row, no fallback; a2a:0.5 / ragged:1 overflow -> gather path.
  # (gather is what the end-to-end steps above run on both EP meshes: "auto" on CPU)
  # (a2a and ragged on fsdp2_expert2_tensor2 have buffers for every row: no fallback, the exchange itself.)
  # ragged:1.9 on fsdp2_expert2_tensor2: buffer 46 of 48 possible rows, the exchange branch of the lax.cond
  # (no device receives more than 46 rows: checked below with the same token layout: 48 padded rows in 4 shards
  # over (fsdp, expert), EP groups = the 2 shards of one fsdp index, device d holds experts 4d..4d+3).
  padded = np.concatenate([np.asarray(ch), np.zeros((8, k), np.int32)])
  recv = [[int(np.sum(padded[24 * f : 24 * f + 24] // 4 == d)) for d in range(2)] for f in range(2)]
  out["ragged:1.9_max_rows_received"] = max(map(max, recv))
  for mesh_name, modes in (
    ("data2_expert4", ("a2a:0.5", "ragged", "ragged:1")),
    ("fsdp2_expert2_tensor2", ("a2a", "ragged", "ragged:1.9")),
  ):
    mesh = parallel.make_mesh(MESHES[mesh_name])
    for mode in modes:
      with parallel.use_mesh(mesh, parallel.DEFAULT_RULES):
        y, g = jax.jit(
          lambda: value_and_grads(lambda x, wg, wu, wd: ep.moe_experts(x, ch, w, wg, wu, wd, 0.5, mode=mode))
        )()
      out[f"{mesh_name}/{mode}"] = {"y": _maxdiff(y, y0), "grad": _maxdiff(g, g0)}
  return out


def _local_attention():
  """parallel.local_ops.sliding_window_attention (shard_map over batch and kv-head shards) = ops on one device."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from stepflash_jax import ops, parallel

  rng = np.random.default_rng(3)
  B, T, Hq, Hkv, D = 4, 16, 6, 2, 8
  q, k, v = (jnp.asarray(rng.standard_normal((B, T, h, D)), jnp.float32) for h in (Hq, Hkv, Hkv))
  seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 6], B, 0), jnp.int32)

  def value_and_grads(attn):
    y, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, window=5, segment_ids=seg), q, k, v)
    return y, vjp(jnp.cos(y))

  y0, g0 = value_and_grads(ops.sliding_window_attention)
  mesh = parallel.make_mesh(MESHES["fsdp2_expert2_tensor2"])  # batch over fsdp x expert, heads over tensor
  with parallel.use_mesh(mesh, parallel.DEFAULT_RULES):
    y, g = jax.jit(lambda: value_and_grads(parallel.local_ops.sliding_window_attention))()
  return {"y": _maxdiff(y, y0), "grad": _maxdiff(g, g0)}


def _pallas_model(cfg):
  """The model with the Pallas attention kernel (interpreted) under a batch x tensor mesh: logits and parameter
  gradients equal one device's, and the compiled program has no all-gather inside an attention block (called on
  sharded q/k/v, GSPMD gathers them for the kernel; parallel/local_ops.py runs it per device instead)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from stepflash_jax import model as model_lib
  from stepflash_jax import parallel

  c = cfg.copy_and_resolve_references()
  c.attention_impl = "pallas"
  args = model_lib.as_args(c)
  variables = model_lib.init(args, jax.random.key(2))
  B, T = 4, 16
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, args.vocab_size, (B, T)), jnp.int32)
  seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 6], B, 0), jnp.int32)

  def loss(params):
    logits = model_lib.apply(args, {**variables, "params": params}, tokens, segment_ids=seg)["logits"]
    return jnp.mean(jnp.cos(logits)), logits

  grad = jax.grad(loss, has_aux=True)
  g0, y0 = jax.jit(grad)(variables["params"])
  mesh = parallel.make_mesh({"data": 2, "tensor": 2, "fsdp": 1, "expert": 1}, devices=jax.devices()[:4])
  with parallel.use_mesh(mesh, parallel.DEFAULT_RULES):
    step = jax.jit(grad)
    hlo = step.lower(variables["params"]).compile().as_text()
    g, y = step(variables["params"])
  gathers = [ln for ln in hlo.splitlines() if " all-gather(" in ln and "/attn/" in ln.split("metadata=")[-1]]
  return {"logits": _maxdiff(y, y0), "grad": _maxdiff(g, g0), "attention_gathers": len(gathers)}


def _muon_collectives(args):
  """Muon update of the model's expert stacks sharded over `expert` (mesh data 2, expert 4): no collective at all.
  On (fsdp 2, expert 2, tensor 2) each expert matrix is split over fsdp x tensor and may be gathered within that
  group, but no collective ever carries the whole stack (a result with the full expert count E)."""
  import re
  import jax
  from stepflash_jax import model as model_lib
  from stepflash_jax import parallel
  from stepflash_jax.train import state as state_lib
  from stepflash_jax.optim.muon import scale_by_stepfun_muon

  out = {}
  variables = model_lib.init(args, jax.random.key(1))
  experts = {
    "layer_1": {"moe": {n: variables["params"]["layer_1"]["moe"][n] for n in ("gate_proj", "up_proj", "down_proj")}}
  }
  E = args.num_experts
  for mesh_name in ("data2_expert4", "fsdp2_expert2_tensor2"):
    mesh = parallel.make_mesh(MESHES[mesh_name])
    rules = parallel.DEFAULT_RULES
    with parallel.use_mesh(mesh, rules):
      tx = scale_by_stepfun_muon(1e-2)
      p = state_lib.place_state(experts, args, mesh, rules)
      st = jax.jit(tx.init)(p)
      hlo = jax.jit(tx.update).lower(p, st, p).compile().as_text()
    colls = re.findall(
      r"= (\w+\[[\d,]*\])[^\n]*? (all-gather|all-reduce|all-to-all|collective-permute|"
      r"reduce-scatter)(?:-start)?\(",
      hlo,
    )
    full = [c for c in colls if re.match(rf"\w+\[{E},", c[0])]
    out[mesh_name] = {
      "collectives": len(colls),
      "full_stack_collectives": len(full),
      "kinds": sorted(set(c[1] for c in colls)),
    }
  return out


def _rollout(args, variables, rules):
  """Greedy fp32 generation with sharded parameters (mesh data 2, expert 4) = one device: same tokens."""
  import jax
  import numpy as np
  from stepflash_jax import parallel
  from stepflash_jax.train import state as state_lib
  from stepflash_jax.sampling import FAST_COMPILE, RolloutEngine

  eng = RolloutEngine(
    args,
    max_prompt_len=6,
    max_new_tokens=5,
    eos_id=1,
    pad_id=0,
    dtype="float32",
    temperature=0.0,
    compiler_options=FAST_COMPILE,
  )
  rng = np.random.default_rng(2)
  prompts = rng.integers(3, 512, (8, 6)).astype(np.int32)
  lens = np.array([6, 4, 5, 6, 3, 6, 2, 6], np.int32)
  prompts[np.arange(6)[None] < (6 - lens)[:, None]] = 0
  ref = jax.device_get(eng.generate(variables, prompts, lens, jax.random.key(0)))
  mesh = parallel.make_mesh(MESHES["data2_expert4"])
  with parallel.use_mesh(mesh, rules):
    v = state_lib.place_state(variables, args, mesh, rules)
    b = parallel.shard_batch({"prompts": prompts, "lens": lens}, mesh, rules)
    got = jax.device_get(eng.generate(v, b["prompts"], b["lens"], jax.random.key(0)))
  return {
    "tokens_equal": bool(np.array_equal(got["response"], ref["response"])),
    "logp_maxdiff": _maxdiff(got["logp"], ref["logp"]),
  }


def _sharded_init(args, variables, rules):
  """train.state.init_variables / init_opt_state: created sharded, same values as model.init on one device."""
  import jax
  from stepflash_jax import parallel
  from stepflash_jax.train import state as state_lib
  from stepflash_jax.optim import muon

  mesh = parallel.make_mesh(MESHES["fsdp2_expert2_tensor2"])
  with parallel.use_mesh(mesh, rules):
    v = state_lib.init_variables(args, jax.random.key(0), mesh, rules)
    tx = muon(1e-3)
    opt = state_lib.init_opt_state(tx, v["params"], args, mesh, rules)
    want = state_lib.variable_shardings(args, mesh, rules)
    opt_sh = state_lib.state_shardings(opt, args, mesh, rules)
  n_sharded_opt = sum(1 for s in jax.tree.leaves(opt_sh) if any(a is not None for a in s.spec))
  return {
    "values_maxdiff": _maxdiff(v, variables),
    "sharding_kept": _kept(v, want),
    "opt_sharding_kept": _kept(opt, opt_sh),
    "opt_leaves_sharded": n_sharded_opt,
  }


if __name__ == "__main__":
  _worker()
