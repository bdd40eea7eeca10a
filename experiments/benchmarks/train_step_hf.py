"""One training step of stepflash_jax vs the Hugging Face PyTorch reference (StepFun's remote `modeling_step3p5.py`).

    pip install -e '.[hfbench]'        # torch==2.13.0 (CPU wheel) + transformers==4.57.*
    python experiments/benchmarks/train_step_hf.py --hf_code_dir DIR [--batch 8 --seq 256 --steps 10 --rounds 3]

DIR holds `modeling_step3p5.py`, the public remote code of the released checkpoint (never copied into this repo).
Without DIR, torch or transformers the script says what is missing and exits 0. The file's
`from .configuration_step3p5 import Step3p5Config` is served by our own `Step3p5Config` below (a
transformers.PretrainedConfig with the fields of vLLM's Step3p5Config that the modeling file reads): the modeling
file is imported under a synthetic package whose `configuration_step3p5` module is registered by this script.

The checkpoint: a random Step3p5 (hidden 256, 8 layers [full, 3 x SWA, full, 3 x SWA], layer 0 dense FFN 512,
layers 1-7 MoE with 16 experts top-2 of width 128 + a shared expert of 128, head_dim 64, 4 full / 6 SWA query heads
over 2 KV heads, window 64, llama3 RoPE scaling and partial rotary on full layers, SwiGLU clamps on the last two
layers, vocab 512, no MTP) written by `save_hf_checkpoint`, then read by `load_hf_checkpoint(dir)` with its default
arguments (what a user gets: scan_layers, "xla" attention / MoE) and by the HF model (`from_pretrained`, fp32).

1. Correctness: main-head logits of both models on the same random [B, T] batch; exits 1 if max |diff| > 1e-3.
2. Timing: float32, AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0.01 on both sides), loss = mean
   next-token cross-entropy of the main head. Each framework runs in its own process (peak RSS = that process's
   ru_maxrss), torch with set_num_threads(os.cpu_count()); the two alternate over --rounds rounds (A B, B A, ...)
   and the medians over rounds are reported. (timing.bench round-robins functions inside one process; here each
   framework needs its own process, so the rounds alternate processes instead.) First step: JAX = lower().compile()
   + the first call; torch = the first call. Steady step: median of the next --steps steps.

The HF model is timed in train() mode when that works; with the released remote code it does not (its attention
reads `self.attention_dropout`, which it never sets), so it is timed in eval() mode with autograd on: the model has
no dropout or other train-only path, so the arithmetic is the same.

Smoke run (--steps 3 --rounds 1, B=8, T=256) on the 2-core CPU while another job held one core, so not a
measurement: logits max |diff| 2.6e-6; stepflash_jax compile 42 s, 4.95 s/step (414 tok/s, 2.1 GB peak RSS); HF
29.9 s/step (68 tok/s, 1.5 GB); losses 6.28098 -> 5.83149 on both sides; ratio 6.05x. Torch's 2 OpenMP threads
suffered most from the busy core (one HF fwd+bwd alone: ~3.5 s with 1 thread, ~31 s with 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.01
TOL = 1e-3
PKG = "_step3p5_hf_remote"  # synthetic package the remote modeling file is imported under


# ---------------------------------------------------------------------------------------------------------------
# The checkpoint (our side).


def tiny_config(vocab=512):
  """The benchmark's Step3p5: model_config with small sizes and the published layer pattern; impl keys default."""
  from stepflash_jax.config import FULL, SWA, model_config

  L = 8
  types_ = [FULL if i % 4 == 0 else SWA for i in range(L)]
  return model_config(
    vocab_size=vocab,
    hidden_size=256,
    head_dim=64,
    num_layers=L,
    num_mtp_layers=0,  # the HF model has no MTP modules (it ignores layers >= num_hidden_layers)
    num_heads=4,
    num_heads_swa=6,
    num_kv_heads=2,
    sliding_window=64,
    layer_types=types_,
    rope_theta=[5e6 if t == FULL else 1e4 for t in types_],
    partial_rotary_factors=[0.5 if t == FULL else 1.0 for t in types_],
    rope_scaling=dict(
      rope_type="llama3", factor=2.0, original_max_position_embeddings=64, low_freq_factor=1.0, high_freq_factor=4.0
    ),
    intermediate_size=512,
    moe_layers=list(range(1, L)),
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    routed_scaling_factor=3.0,
    swiglu_limits=[7.0 if i in (L - 2, L - 1) else 0.0 for i in range(L)],
    swiglu_limits_shared=[16.0 if i == L - 1 else 0.0 for i in range(L)],
    max_position_embeddings=4096,
  )


def write_checkpoint(path, vocab, seed=0):
  import jax
  import stepflash_jax as sfj

  cfg = tiny_config(vocab)
  variables = sfj.init(cfg, jax.random.PRNGKey(seed))
  sfj.save_hf_checkpoint(cfg, variables, path)


# ---------------------------------------------------------------------------------------------------------------
# The HF side: our config class and the remote modeling file under a synthetic package.


# Step3p5Config fields the modeling file reads, with vLLM's defaults (the released 196B model).
HF_CONFIG_DEFAULTS = dict(
  vocab_size=128896,
  hidden_size=4096,
  intermediate_size=11264,
  num_hidden_layers=45,
  num_attention_heads=64,
  num_attention_groups=8,
  head_dim=128,
  rms_norm_eps=1e-5,
  max_position_embeddings=262144,
  max_seq_len=262144,
  use_moe=True,
  moe_layers_enum=None,
  moe_num_experts=288,
  moe_top_k=8,
  moe_intermediate_size=1280,
  share_expert_dim=None,
  norm_expert_weight=True,
  moe_router_activation="sigmoid",
  moe_router_scaling_factor=3.0,
  use_moe_router_bias=True,
  need_fp32_gate=True,
  use_head_wise_attn_gate=True,
  sliding_window=512,
  layer_types=None,
  attention_other_setting=None,
  rope_theta=10000.0,
  rope_scaling=None,
  partial_rotary_factors=None,
  yarn_only_types=None,
  use_rope_layers=None,
  num_nextn_predict_layers=0,
  swiglu_limits=None,
  swiglu_limits_shared=None,
  use_cache=False,
)


def hf_config_class():
  """Step3p5Config for modeling_step3p5.py: the fields it reads, named as in vLLM's Step3p5Config (ours)."""
  from transformers import PretrainedConfig

  class Step3p5Config(PretrainedConfig):
    model_type = "step3p5"

    def __init__(self, tie_word_embeddings=False, **kwargs):
      fields = {k: kwargs.pop(k, v) for k, v in HF_CONFIG_DEFAULTS.items()}
      self.__dict__.update(fields)
      L, Hq, G, D = (
        fields["num_hidden_layers"],
        fields["num_attention_heads"],
        fields["num_attention_groups"],
        fields["head_dim"],
      )
      self.num_key_value_heads, self.num_experts_per_tok = G, fields["moe_top_k"]
      if fields["share_expert_dim"] is None:
        self.share_expert_dim = fields["moe_intermediate_size"] * fields["moe_top_k"]
      self.layer_types = fields["layer_types"] or [
        "full_attention" if i % 4 == 0 else "sliding_attention" for i in range(L)
      ]
      self.attention_other_setting = fields["attention_other_setting"] or {
        "attention_type": "sliding_attention",
        "num_attention_heads": Hq,
        "num_attention_groups": G,
        "head_dim": D,
      }
      self.yarn_only_types = fields["yarn_only_types"] or ["full_attention"]
      super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

  return Step3p5Config


def load_hf_modeling(code_dir):
  """Import DIR/modeling_step3p5.py as PKG.modeling_step3p5, with PKG.configuration_step3p5 = our config."""
  if PKG + ".modeling_step3p5" in sys.modules:
    return sys.modules[PKG + ".modeling_step3p5"]
  pkg = types.ModuleType(PKG)
  pkg.__path__ = [os.path.abspath(code_dir)]
  sys.modules[PKG] = pkg
  conf = types.ModuleType(PKG + ".configuration_step3p5")
  conf.Step3p5Config = hf_config_class()
  sys.modules[conf.__name__] = conf
  spec = importlib.util.spec_from_file_location(
    PKG + ".modeling_step3p5", os.path.join(code_dir, "modeling_step3p5.py")
  )
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod
  spec.loader.exec_module(mod)
  return mod


def load_hf_model(code_dir, ckpt):
  """(Step3p5ForCausalLM in fp32 with the checkpoint's weights, note)."""
  import torch

  mod = load_hf_modeling(code_dir)
  config = sys.modules[PKG + ".configuration_step3p5"].Step3p5Config.from_pretrained(ckpt)
  model, info = mod.Step3p5ForCausalLM.from_pretrained(
    ckpt, config=config, dtype=torch.float32, output_loading_info=True
  )
  bad = {k: v for k, v in info.items() if v}
  if bad:
    raise RuntimeError(f"HF from_pretrained did not load the checkpoint cleanly: {bad}")
  # Every tensor of the checkpoint, router biases included, must have arrived unchanged.
  from safetensors.numpy import load_file

  sd = model.state_dict()
  for name, t in load_file(os.path.join(ckpt, "model.safetensors")).items():
    if not np.array_equal(sd[name].detach().numpy(), t):
      raise RuntimeError(f"HF model: tensor {name} differs from the checkpoint")
  return model, f"attn_implementation={model.config._attn_implementation}"


# ---------------------------------------------------------------------------------------------------------------
# Workers (one process per framework and task).


def jax_worker(a, tokens):
  import jax
  import jax.numpy as jnp
  import optax
  import stepflash_jax as sfj
  from stepflash_jax import model as model_lib

  cfg, variables = sfj.load_hf_checkpoint(a.ckpt)
  args = model_lib.as_args(cfg)
  note = f"scan plan {args.scan or 'none'}, attention_impl={cfg.attention_impl}, moe_impl={cfg.moe_impl}"
  if a.task == "logits":
    return {"logits": np.asarray(sfj.forward(cfg, variables, tokens)), "note": note}

  tx = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)

  def loss_fn(params, router, tokens):  # the trainers' path: vocabulary-chunked log-probs, no [B, T, V] logits
    head = model_lib.apply(args, {"params": params, "router": router}, tokens, logits=False)["heads"][0]
    logp = model_lib.head_logprobs(head, jnp.roll(tokens, -1, 1))[0]  # [B, T]; the last column has no target
    return -jnp.mean(logp[:, :-1])

  def step(params, opt, router, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, router, tokens)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, loss

  params, router = variables["params"], variables["router"]
  opt = tx.init(params)
  tokens = jnp.asarray(tokens, jnp.int32)
  t0 = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt, router, tokens).compile()
  compile_s = time.perf_counter() - t0
  times, losses = [], []
  for _ in range(a.steps + 1):
    t0 = time.perf_counter()
    params, opt, loss = compiled(params, opt, router, tokens)
    losses.append(float(jax.block_until_ready(loss)))
    times.append(time.perf_counter() - t0)
  return {"compile_s": compile_s, "first_s": compile_s + times[0], "steps_s": times[1:], "losses": losses, "note": note}


def hf_worker(a, tokens):
  import torch
  import torch.nn.functional as F

  torch.set_num_threads(os.cpu_count())
  torch.manual_seed(0)
  model, note = load_hf_model(a.hf_code_dir, a.ckpt)
  ids = torch.from_numpy(tokens.astype(np.int64))
  if a.task == "logits":
    model.eval()
    with torch.no_grad():
      logits = model(input_ids=ids, use_cache=False).logits
    return {"logits": logits.numpy(), "note": note}

  model.train()
  try:  # probe train() mode on a few tokens
    with torch.no_grad():
      model(input_ids=ids[:1, :8], use_cache=False)
    note += ", train() mode"
  except AttributeError as e:
    model.eval()
    note += f", eval() mode with autograd (train() fails: {e})"
  params = [p for p in model.parameters() if p.requires_grad]  # router biases have requires_grad=False
  opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
  V = model.config.vocab_size
  times, losses = [], []
  for _ in range(a.steps + 1):
    t0 = time.perf_counter()
    logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(float(loss.detach()))
    times.append(time.perf_counter() - t0)
  return {"first_s": times[0], "steps_s": times[1:], "losses": losses, "note": note}


def worker(a):
  tokens = np.load(a.tokens)
  out = (jax_worker if a.worker == "jax" else hf_worker)(a, tokens)
  out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
  logits = out.pop("logits", None)
  if logits is not None:
    np.save(a.out + ".npy", logits.astype(np.float32))
  with open(a.out, "w") as f:
    json.dump(out, f)


def run_worker(a, fw, task, tmp, ckpt, tokens_path, tag):
  out = os.path.join(tmp, f"{fw}_{task}_{tag}.json")
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "--_worker",
    fw,
    "--_task",
    task,
    "--_ckpt",
    ckpt,
    "--_tokens",
    tokens_path,
    "--_out",
    out,
    "--steps",
    str(a.steps),
  ]
  if a.hf_code_dir:
    cmd += ["--hf_code_dir", a.hf_code_dir]
  p = subprocess.run(cmd, capture_output=True, text=True)
  if p.returncode != 0:
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr)
    raise SystemExit(f"{fw} worker ({task}) failed with exit code {p.returncode}")
  with open(out) as f:
    res = json.load(f)
  if task == "logits":
    res["logits"] = np.load(out + ".npy")
  return res


# ---------------------------------------------------------------------------------------------------------------

NAMES = {"jax": "stepflash_jax", "hf": "HF (torch)"}


def missing(a):
  """What keeps the benchmark from running (empty = nothing)."""
  out = []
  if not a.hf_code_dir:
    out.append("--hf_code_dir DIR (a folder holding StepFun's public modeling_step3p5.py)")
  elif not os.path.isfile(os.path.join(a.hf_code_dir, "modeling_step3p5.py")):
    out.append(f"{os.path.join(a.hf_code_dir, 'modeling_step3p5.py')} (no such file)")
  for pkg in ("torch", "transformers"):
    if importlib.util.find_spec(pkg) is None:
      out.append(f"the Python package '{pkg}' (pip install -e '.[hfbench]')")
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--hf_code_dir", default=None, help="folder holding modeling_step3p5.py (StepFun's remote code)")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--vocab", type=int, default=512)
  ap.add_argument("--steps", type=int, default=10, help="steady steps timed after the first one")
  ap.add_argument("--rounds", type=int, default=3)
  for hidden in ("--_worker", "--_task", "--_ckpt", "--_tokens", "--_out"):
    ap.add_argument(hidden, dest=hidden[3:], default=None, help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.worker:
    return worker(a)

  lacking = missing(a)
  if lacking:
    print("train_step_hf: skipped, missing " + "; ".join(lacking))
    return 0
  import torch
  import transformers

  print(
    f"B={a.batch} T={a.seq} fp32, AdamW lr={LR}, {a.steps} steady steps x {a.rounds} rounds; "
    f"torch {torch.__version__}, transformers {transformers.__version__}, {os.cpu_count()} CPUs"
  )
  with tempfile.TemporaryDirectory(prefix="train_step_hf_") as tmp:
    ckpt = os.path.join(tmp, "ckpt")
    write_checkpoint(ckpt, a.vocab)
    tokens_path = os.path.join(tmp, "tokens.npy")
    np.save(tokens_path, np.random.default_rng(0).integers(0, a.vocab, (a.batch, a.seq), dtype=np.int32))

    ref = {fw: run_worker(a, fw, "logits", tmp, ckpt, tokens_path, "check") for fw in ("jax", "hf")}
    for fw, r in ref.items():
      print(f"{NAMES[fw]}: {r['note']}")
    diff = float(np.max(np.abs(ref["jax"]["logits"] - ref["hf"]["logits"])))
    scale = float(np.max(np.abs(ref["hf"]["logits"])))
    print(f"logits [{a.batch}, {a.seq}, {a.vocab}]: max |stepflash_jax - HF| = {diff:.3g} (max |logit| {scale:.3g})")
    if not diff <= TOL:
      print(f"FAILED: logits differ by more than {TOL}", file=sys.stderr)
      return 1

    res = {"jax": [], "hf": []}
    tok = a.batch * a.seq
    for r in range(a.rounds):
      for fw in ("jax", "hf") if r % 2 == 0 else ("hf", "jax"):
        x = run_worker(a, fw, "train", tmp, ckpt, tokens_path, str(r))
        x["step_s"] = statistics.median(x["steps_s"])
        res[fw].append(x)
        comp = f" (compile {x['compile_s']:.2f} s)" if "compile_s" in x else ""
        print(
          f"round {r + 1} {NAMES[fw]:<14} first step {x['first_s']:.2f} s{comp}, step {x['step_s']:.3f} s, "
          f"{tok / x['step_s']:.0f} tok/s, peak RSS {x['peak_rss_mib']:.0f} MiB, "
          f"loss {x['losses'][0]:.5f} -> {x['losses'][-1]:.5f}"
        )
    print(f"HF: {res['hf'][0]['note']}")

  med = lambda fw, k: statistics.median(x[k] for x in res[fw])
  print(f"median over {a.rounds} round(s):")
  print(f"  {'framework':<15}{'first step s':>13}{'compile s':>11}{'step s':>9}{'tokens/s':>10}{'peak RSS MiB':>14}")
  for fw in ("jax", "hf"):
    comp = f"{med(fw, 'compile_s'):.2f}" if fw == "jax" else "-"
    print(
      f"  {NAMES[fw]:<15}{med(fw, 'first_s'):>13.2f}{comp:>11}{med(fw, 'step_s'):>9.3f}"
      f"{tok / med(fw, 'step_s'):>10.0f}{med(fw, 'peak_rss_mib'):>14.0f}"
    )
  print(f"ratio (stepflash_jax / HF) tokens/s: {med('hf', 'step_s') / med('jax', 'step_s'):.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())
