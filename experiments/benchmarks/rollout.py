"""Rollout engine: KV-cached decoding vs recompute-from-scratch, KV-cache bytes, MTP-3 speculative decoding,
continuous vs static batching, and against transformers' `generate`.

    python experiments/benchmarks/rollout.py [--batch 8 --new_tokens 256 --prompt_len 16 --train_steps 300]
    python experiments/benchmarks/rollout.py --skip 1,2,3,4,6 --hf_code_dir DIR   # section 5 only

1. Greedy decoding of `new_tokens` tokens, tiny config, fp32: the engine (prefill + one cached token per step) vs a
   no-cache decoder that reruns the full forward over the fixed [B, P + N] buffer every step (one compiled program,
   no recompiles; a growing-length recompute would do at most ~2x less work). Every recompute step costs the same,
   so it is timed over `recompute_steps` steps and scaled to N. Goal >= 10x.
2. KV-cache bytes per sequence: ring buffers for sliding-window layers (window + lookahead slots) vs full caches
   on every layer; tiny config and the full-size model at 32K / 128K context (abstract shapes, bf16, nothing
   allocated).
3. MTP-3 speculative decoding: acceptance rate, tokens per main-model call and wall-time speed-up over plain cached
   decoding, greedy and temperature 1, for the untrained tiny model and one trained for `train_steps` AdamW steps
   (main + 0.3 * MTP loss, batch 8 x 48 tokens) on a noisy Markov chain (x_{t+1} = f(x_t) with prob. 0.9, else
   uniform over 64 tokens).
4. Continuous vs static batching on a mix of short and long responses: 4 x `batch` requests in random order, a
   quarter with a budget of `new_tokens` tokens and the rest `new_tokens / 16`, temperature 1, bf16. Static: groups
   of `batch` requests in queue order, each decoded until its longest budget (an engine per budget); continuous:
   `batch` slots over the whole queue (`generate_queue`). Tokens/s counts the budgeted response tokens. Goal >= 1.5x.
5. Our engine vs Hugging Face transformers' `generate` (KV cache on) on one checkpoint: train_step_hf.py's random
   Step3p5 (hidden 256, 8 layers, 16 experts top-2, vocab 512) written by `save_hf_checkpoint`, read back by
   `load_hf_checkpoint` (ours) and by StepFun's public modeling_step3p5.py (`--hf_code_dir`, as in
   train_step_hf.py; torch and transformers from the `hfbench` extra). Greedy, float32 on both sides, `batch`
   random prompts of `prompt_len` tokens, `new_tokens` new tokens, EOS = 1 on both sides; median of `reps` calls
   after a warm-up (ours: after its compile), and the fraction of generated tokens on which the two agree. The
   remote code mishandles per-row position ids for batches > 1, so its `generate` runs with the default positions
   (the same here: every prompt has `prompt_len` tokens).
   Skipped with a message when the modeling file, torch or transformers is missing. Goal >= 3x.
6. KV-cache storage of a bf16 engine on CPU at the main job's rollout shapes (`storage_batch` rows, 20-token prompts,
   48 new tokens, temperature 1): fp32 storage (model/cache.py, the default on CPU) vs bf16 storage, the two
   programs timed in alternation; their tokens must be equal (exits 1 if not), log-probs equal to float rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stepflash_jax as sfj
from stepflash_jax import model as M
from stepflash_jax.config import load_config_file, model_config
from stepflash_jax.model.cache import cache_bytes, init_cache
from stepflash_jax.sampling import RolloutEngine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOS, PAD = 1, 0
VOCAB_SUB = 64  # the Markov chain lives on tokens 2 .. 2 + VOCAB_SUB


def timed(fn, reps):
  """Median wall seconds over reps calls (after a compile + warm-up call); fn(i) -> pytree."""
  jax.block_until_ready(fn(0))
  times = []
  for i in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(i + 1))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def recompute_decoder(args, P, N, steps):
  """Greedy decoding without a cache: the full forward over the [B, P + N] buffer at each of `steps` steps."""

  def run(v, prompts, lens):
    B = prompts.shape[0]
    pad = P - lens
    col = jnp.arange(P + N)[None]
    seg = (col >= pad[:, None]).astype(jnp.int32)
    pos = jnp.maximum(col - pad[:, None], 0)
    buf = jnp.concatenate([prompts, jnp.full((B, N), PAD, jnp.int32)], 1)

    def step(i, buf):
      logits = M.apply(args, v, buf, positions=pos, segment_ids=seg)["logits"]
      tok = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, P + i - 1, 1, keepdims=False), -1).astype(jnp.int32)
      return jax.lax.dynamic_update_index_in_dim(buf, tok, P + i, 1)

    return jax.lax.fori_loop(0, steps, step, buf)[:, P : P + steps]

  return jax.jit(run)


def make_prompts(rs, B, P, markov=None):
  lens = rs.randint(P // 2, P + 1, B).astype(np.int32)
  prompts = np.full((B, P), PAD, np.int32)
  for b in range(B):
    if markov is None:
      prompts[b, P - lens[b] :] = rs.randint(2, 512, lens[b])
    else:
      prompts[b, P - lens[b] :] = markov_sequences(rs, markov, 1, lens[b])[0]
  return prompts, lens


def markov_sequences(rs, f, B, T, p_follow=0.9):
  x = np.zeros((B, T), np.int32)
  x[:, 0] = rs.randint(0, VOCAB_SUB, B)
  for t in range(1, T):
    follow = rs.rand(B) < p_follow
    x[:, t] = np.where(follow, f[x[:, t - 1]], rs.randint(0, VOCAB_SUB, B))
  return x + 2


def train_markov(cfg, v, f, steps, batch=8, T=48, lr=1e-2, seed=0):
  """AdamW on main + 0.3 * MTP next-token losses over Markov-chain sequences; returns (variables, last loss)."""
  warm = min(20, max(1, steps // 5))
  opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, warm, max(steps, warm + 1)), weight_decay=0.0)
  params = v["params"]
  state = opt.init(params)

  def loss_fn(params, x):
    out = sfj.apply(cfg, {"params": params, "router": v["router"]}, x, mtp=True)
    ce = lambda lg, y: -jnp.take_along_axis(jax.nn.log_softmax(lg), y[..., None], -1).mean()
    main = ce(out["logits"][:, :-1], x[:, 1:])
    mtp = sum(ce(lg[:, : -(k + 2)], x[:, k + 2 :]) for k, lg in enumerate(out["mtp_logits"]))
    return main + 0.3 * mtp, (main, mtp)

  @jax.jit
  def step(params, state, x):
    (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(params, x)
    upd, state = opt.update(g, state, params)
    return optax.apply_updates(params, upd), state, aux

  rs = np.random.RandomState(seed)
  for _ in range(steps):
    params, state, aux = step(params, state, jnp.asarray(markov_sequences(rs, f, batch, T)))
  return {"params": params, "router": v["router"]}, [float(x) for x in aux]


def section_cache_vs_recompute(cfg, v, a):
  print(
    f"\n== 1. cached decode vs recompute-from-scratch: tiny, fp32, greedy, batch {a.batch}, prompt "
    f"{a.prompt_len}, {a.new_tokens} new tokens =="
  )
  rs = np.random.RandomState(0)
  prompts, lens = make_prompts(rs, a.batch, a.prompt_len)
  eng = RolloutEngine(
    cfg,
    max_prompt_len=a.prompt_len,
    max_new_tokens=a.new_tokens,
    eos_id=EOS,
    pad_id=PAD,
    dtype="float32",
    temperature=0.0,
  )
  n_rec = min(a.recompute_steps, a.new_tokens)
  rec = recompute_decoder(M.as_args(cfg), a.prompt_len, a.new_tokens, n_rec)
  out = eng.generate(v, prompts, lens, jax.random.key(0))
  same = float(np.mean(np.asarray(out["response"])[:, :n_rec] == np.asarray(rec(v, prompts, lens))))
  t_cache = timed(lambda i: eng.generate(v, prompts, lens, jax.random.key(i)), a.reps)
  t_rec = timed(lambda i: rec(v, prompts, lens), 1) * a.new_tokens / n_rec
  n_tok = a.batch * a.new_tokens
  print(f"{'method':<26}{'s / generate':>14}{'tokens / s':>12}")
  print(f"{'KV-cached (engine)':<26}{t_cache:>14.3f}{n_tok / t_cache:>12.0f}")
  print(f"{'recompute full forward':<26}{t_rec:>14.3f}{n_tok / t_rec:>12.0f}")
  print(
    f"speed-up {t_rec / t_cache:.1f}x (goal >= 10x; recompute timed over {n_rec} steps and scaled); identical "
    f"greedy tokens (first {n_rec}): {same:.1%}; "
    f"all rows ran {a.new_tokens} tokens: {bool(np.all(np.asarray(out['lengths']) == a.new_tokens))}"
  )


def _cache_sizes(args, length, lookahead, dtype):
  ring = jax.eval_shape(lambda: init_cache(args, 1, length, lookahead, dtype))
  full_args = dataclasses.replace(args, layers=tuple(dataclasses.replace(s, window=None) for s in args.layers))
  full = jax.eval_shape(lambda: init_cache(full_args, 1, length, lookahead, dtype))
  return cache_bytes(ring), cache_bytes(full)


def section_cache_bytes(cfg):
  print("\n== 2. KV-cache bytes per sequence (k, v and int32 positions; ring = window + lookahead slots) ==")
  print(f"{'model':<10}{'dtype':<10}{'context':>9}{'ring buffers':>16}{'all full':>16}{'saving':>9}")
  tiny = M.as_args(cfg)
  big = M.as_args(model_config())
  rows = [("tiny", tiny, n, "float32") for n in (128, 512, 4096)]
  rows += [("Step3.5", big, n, "bfloat16") for n in (512, 32768, 131072)]
  for name, args, n, dt in rows:
    ring, full = _cache_sizes(args, n, 3, jnp.dtype(dt))
    fmt = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"
    print(f"{name:<10}{dt:<10}{n:>9}{fmt(ring):>16}{fmt(full):>16}{full / ring:>8.1f}x")


def section_spec(cfg, v, a):
  print(
    f"\n== 3. MTP-3 speculative decoding vs plain cached decoding: tiny, fp32, batch {a.batch}, "
    f"{a.new_tokens} new tokens =="
  )
  rs = np.random.RandomState(1)
  f = rs.permutation(VOCAB_SUB)
  t0 = time.perf_counter()
  trained, (main_loss, mtp_loss) = train_markov(cfg, v, f, a.train_steps)
  print(
    f"trained {a.train_steps} AdamW steps in {time.perf_counter() - t0:.0f} s: main CE {main_loss:.2f}, "
    f"sum of 3 MTP CEs {mtp_loss:.2f} (chain entropy floor ~{-(0.9 * np.log(0.9) + 0.1 * np.log(0.1 / 64)):.2f}"
    f" per token)"
  )
  engines = {}
  for spec in (False, True):
    engines[spec] = RolloutEngine(
      cfg,
      max_prompt_len=a.prompt_len,
      max_new_tokens=a.new_tokens,
      eos_id=EOS,
      pad_id=PAD,
      dtype="float32",
      spec_decode=spec,
    )
  print(f"{'model':<10}{'temp':>5}{'accept':>8}{'tok/call':>10}{'steps':>7}{'plain s':>9}{'spec s':>8}{'speed-up':>10}")
  for name, var, markov in (("untrained", v, None), ("trained", trained, f)):
    prompts, lens = make_prompts(np.random.RandomState(2), a.batch, a.prompt_len, markov)
    for temp in (0.0, 1.0):
      for e in engines.values():
        e.temperature = temp
      gen = lambda spec: lambda i: engines[spec].generate(var, prompts, lens, jax.random.key(i))
      out = jax.device_get(gen(True)(0))
      t_plain, t_spec = timed(gen(False), a.reps), timed(gen(True), a.reps)
      print(
        f"{name:<10}{temp:>5.1f}{float(out['accept_rate']):>8.2f}{float(out['tokens_per_call']):>10.2f}"
        f"{int(out['num_steps']):>7}{t_plain:>9.3f}{t_spec:>8.3f}{t_plain / t_spec:>9.2f}x"
      )


def section_continuous(cfg, v, a):
  B, P, N = a.batch, a.prompt_len, a.new_tokens
  rs = np.random.RandomState(4)
  Q, short = 4 * B, max(1, N // 16)
  limits = rs.permutation(np.r_[np.full(Q // 4, N), np.full(Q - Q // 4, short)]).astype(np.int32)
  prompts, lens = make_prompts(rs, Q, P)
  kw = dict(max_prompt_len=P, eos_id=EOS, pad_id=PAD, dtype="bfloat16")
  engines = {n: RolloutEngine(cfg, max_new_tokens=n, **kw) for n in (short, N)}
  groups = [slice(i, i + B) for i in range(0, Q, B)]

  def static(i):
    key = jax.random.key(i)
    return [
      engines[int(limits[g].max())].generate(v, prompts[g], lens[g], jax.random.fold_in(key, j))
      for j, g in enumerate(groups)
    ]

  cont = lambda i: engines[N].generate_queue(v, prompts, lens, jax.random.key(i), slots=B, limits=limits)
  t_static, t_cont = timed(static, a.reps), timed(cont, a.reps)
  tokens = int(limits.sum())  # EOS is rare for the untrained model: every response runs to its budget
  print(
    f"\n4. continuous vs static batching: {Q} requests ({Q // 4} x {N} + {Q - Q // 4} x {short} tokens), "
    f"{B} slots, bf16"
  )
  print(f"   static     {t_static:7.2f} s  {tokens / t_static:8.0f} tok/s")
  print(
    f"   continuous {t_cont:7.2f} s  {tokens / t_cont:8.0f} tok/s   speed-up {t_static / t_cont:.2f}x (goal >= 1.5)"
  )


def section_cache_storage(cfg, v, a):
  from stepflash_jax.model import cache as cache_lib
  from stepflash_jax.sampling import engine as engine_lib

  B, P, N = a.storage_batch, 20, 48
  prompts, lens = make_prompts(np.random.RandomState(6), B, P)
  eng = RolloutEngine(cfg, max_prompt_len=P, max_new_tokens=N, eos_id=EOS, pad_id=PAD, dtype="bfloat16")
  default, fns, outs, times = cache_lib.storage_dtype, {}, {}, {}
  for name, rule in (("fp32 (default)", default), ("bf16", jnp.dtype)):
    cache_lib.storage_dtype = rule  # read when the program is traced: once, by the first call below
    engine_lib._compiled.cache_clear()
    fns[name] = engine_lib._compiled(eng._shapes, False, eng._options)
    outs[name] = jax.device_get(eng.generate(v, prompts, lens, jax.random.key(0)))
    cache_lib.storage_dtype, times[name] = default, []
  engine_lib._compiled.cache_clear()
  args = eng._inputs(prompts, lens)
  for i in range(a.reps):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(v, *args, eng.sampling, jax.random.key(i + 1)))
      times[name].append(time.perf_counter() - t0)
  pairs = list(zip(*(jax.tree.leaves(o) for o in outs.values())))
  same = all(np.array_equal(x, y) for x, y in pairs if not np.issubdtype(x.dtype, np.floating))
  diff = max(float(np.abs(x - y).max()) for x, y in pairs if np.issubdtype(x.dtype, np.floating))
  t32, t16 = (statistics.median(t) for t in times.values())
  print(f"\n6. bf16 engine on {jax.default_backend()}, {B} rows x {N} tokens: KV cache stored in fp32 vs in bf16")
  print(f"   fp32 storage {t32:7.2f} s   bf16 storage {t16:7.2f} s   speed-up {t16 / t32:.2f}x")
  print(f"   same tokens: {same}; max |difference| of the float outputs (log-probs, confidences): {diff:.1e}")
  if not same:
    raise SystemExit("the two storages gave different tokens")


def section_hf_generate(a):
  from train_step_hf import load_hf_model, missing, write_checkpoint  # this script's folder is on sys.path

  lacking = missing(a)
  if lacking:
    print("\n5. vs transformers' generate: skipped, missing " + "; ".join(lacking))
    return
  import tempfile

  import torch

  B, P, N = a.batch, a.prompt_len, a.new_tokens
  prompts = np.random.RandomState(5).randint(2, 512, (B, P)).astype(np.int32)
  with tempfile.TemporaryDirectory() as ckpt:
    write_checkpoint(ckpt, 512)
    cfg, v = sfj.load_hf_checkpoint(ckpt)
    hf, note = load_hf_model(a.hf_code_dir, ckpt)
  hf.eval()
  prepare = hf.prepare_inputs_for_generation

  def without_position_ids(*args, **kwargs):  # (named kwargs: generate() inspects the signature)
    # The remote code's RoPE broadcasts [B, T] position ids against [B, heads, T, D] (right only for B = 1); the
    # prompts have one length, so the model's default (the cache positions) are the same positions.
    out = prepare(*args, **kwargs)
    out.pop("position_ids", None)
    return out

  hf.prepare_inputs_for_generation = without_position_ids
  engine = RolloutEngine(
    cfg, max_prompt_len=P, max_new_tokens=N, eos_id=EOS, pad_id=PAD, dtype="float32", temperature=0.0
  )
  ours = lambda i: engine.generate(v, prompts, np.full(B, P, np.int32), jax.random.key(i))
  ids = torch.from_numpy(prompts.astype(np.int64))
  kw = dict(max_new_tokens=N, do_sample=False, use_cache=True, eos_token_id=EOS, pad_token_id=PAD)

  def theirs(i):
    with torch.no_grad():
      return hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)[:, P:]

  t_ours, t_hf = timed(ours, a.reps), timed(theirs, a.reps)
  got, ref = np.asarray(ours(0)["response"]), theirs(0).numpy()
  agree = float(np.mean(got[:, : ref.shape[1]] == ref))
  print(
    f"\n5. vs transformers' generate: {B} prompts x {P} tokens + {N} new, greedy, float32 "
    f"({note}, torch {torch.__version__})"
  )
  print(f"   transformers {t_hf:7.2f} s  {B * N / t_hf:8.0f} tok/s")
  print(f"   ours         {t_ours:7.2f} s  {B * N / t_ours:8.0f} tok/s   ratio {t_hf / t_ours:.2f}x (goal >= 3)")
  print(f"   same greedy tokens: {agree:.3f} of {ref.size}")


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default=os.path.join(ROOT, "configs", "model", "tiny.py"))
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt_len", type=int, default=16)
  ap.add_argument("--new_tokens", type=int, default=256)
  ap.add_argument("--train_steps", type=int, default=100)
  ap.add_argument("--recompute_steps", type=int, default=32)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--hf_code_dir", default=None, help="section 5: folder holding StepFun's modeling_step3p5.py")
  ap.add_argument("--storage_batch", type=int, default=384, help="section 6: rows (the main job's rollout: 384)")
  ap.add_argument("--skip", default="", help="comma-separated sections to skip: 1,2,3,4,5,6")
  a = ap.parse_args()
  cfg = load_config_file(a.config)
  v = sfj.init(cfg, jax.random.key(0))
  print(f"backend={jax.default_backend()} config={os.path.basename(a.config)}")
  skip = set(a.skip.split(","))
  if "1" not in skip:
    section_cache_vs_recompute(cfg, v, a)
  if "2" not in skip:
    section_cache_bytes(cfg)
  if "3" not in skip:
    section_spec(cfg, v, a)
  if "4" not in skip:
    section_continuous(cfg, v, a)
  if "5" not in skip:
    section_hf_generate(a)
  if "6" not in skip:
    section_cache_storage(cfg, v, a)


if __name__ == "__main__":
  main()
