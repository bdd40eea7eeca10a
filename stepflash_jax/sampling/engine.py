"""Rollout ("inference") engine: KV-cached sampling with its own numerics. Its log-probs are pi_vllm (docs/rl.md §0).

    engine = RolloutEngine(cfg, max_prompt_len=32, max_new_tokens=64, eos_id=tok.eos_id, pad_id=tok.pad_id,
                           dtype="bfloat16", temperature=1.0, top_p=1.0, logit_noise=0.0, spec_decode=False)
    out = engine.generate(variables, prompts, prompt_lens, jax.random.key(0))     # prompts [B, P] LEFT-padded

Output dict (N = max_new_tokens, P = max_prompt_len):
  tokens [B, P + N] int32      prompt (left-padded to P) + response
  response [B, N] int32        pad_id after the EOS token / after the row stopped
  response_mask [B, N] f32     1 on generated tokens (incl. the EOS token), 0 after
  logp [B, N] f32              log-prob of each token under the distribution it was sampled from (after logit noise,
                               temperature, top-p); 0 where masked. Greedy (temperature 0): log-softmax at T = 1.
  lengths [B] int32, truncated [B] bool (no EOS within N)
  routing_confidence f32       Sigma_k of the rollout: mean over MoE layers of the sown "confidence", averaged over
                               decode calls weighted by their valid tokens (plain: the fed response tokens; spec:
                               every verified token incl. rejected drafts). routing_confidence_prompt: the prefill's.
  routing_confidence_layers    {MoE layer path: f32} the same per MoE layer (routing_confidence is their mean).
  spec only: accept_rate (accepted / proposed drafts), tokens_per_call (response tokens / main-model calls per row,
             prefill included; 1.0 for plain decoding), num_steps (verify iterations).

Numerics: dtype "bfloat16" runs the model with bf16 weights/activations/KV cache (router, norms, softmax and logits
stay fp32 inside the model); "float32" reproduces the training forward. Sampling: logits + logit_noise * N(0, 1)
(a controlled train/inference mismatch), then / temperature, then the top-p nucleus, renormalised.

Cache layout. Prompts are left-padded to P columns; row b has pad_b = P - len_b pad columns (segment 0, stored
position -1, never attended) and its token at position p lives in column p + pad_b of every cache (full-attention
layers: slot = column; sliding-window ring buffers: slot = column % S).
  * plain decoding: every row writes the common column P + i - 1 at step i (one lax.while_loop, early exit when all
    rows hit EOS);
  * MTP-K speculative decoding (K = 3): rows advance by different amounts, so every call writes at per-row columns
    (cache_index int [B]). Rejected drafts are rolled back by *position*: after a verify call every cache entry with a
    position beyond the row's last accepted one is marked empty (pos = -1), and the next call overwrites its slots.
    Ring buffers keep window + K (main) / window + K + 1 (MTP) slots so no entry still inside a window is evicted.

Speculative step (positions; s = last position already in the main cache, x_{s+1} the next, committed token):
  verify: main model on [x_{s+1}, d_1..d_K] at s+1..s+K+1 -> p_0..p_K; accept d_j with prob min(1, p_{j-1}(d_j) /
    q_j(d_j)) (greedy: iff d_j = argmax p_{j-1}); at the first rejection j sample normalise(max(0, p_{j-1} - q_j)),
    after K acceptances sample a bonus token from p_K, so every committed token is distributed exactly as p. logp is
    log p of the committed token; commits stop at EOS and at N tokens.
  draft: MTP module k at position t reads h_{k-1}(t) (h_{-1} = backbone hidden) and token t+k+1, predicts t+k+2.
    Module k keeps a cache of its entries at positions <= s_new - k (those whose inputs are all committed tokens);
    each step it runs K+1+k columns from position s-k+1 (valid up to s_new = s+1+n, masked per row; module k >= 1
    gets h_{k-1}(s-k+1) carried over from the previous step). Its output at s_new gives q_{k+1} (temperature /
    top-p, no noise) and the draft d_{k+1}; entries that read drafts are rolled back. With drafts equal to the true
    tokens every entry equals the training forward's MTP output (tests/test_rollout.py).

generate() is one jitted XLA program (prefill + lax.while_loop of decode / verify steps), compiled once per
(model, dtype, P, N, spec_decode, batch size) and shared by engines that differ only in temperature / top_p /
logit_noise / eos / pad (traced inputs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from stepflash_jax import model as M
from stepflash_jax.checks import is_int
from stepflash_jax.model.cache import init_cache
from stepflash_jax.sampling.calls import cast_variables, model_call
from stepflash_jax.sampling.continuous import generate_continuous
from stepflash_jax.sampling.plain import Sampling, Shapes, generate_plain
from stepflash_jax.sampling.quantize import QUANT_FORMATS
from stepflash_jax.sampling.speculative import generate_spec

ENGINE_DTYPES = ("bfloat16", "float32")
# XLA options that halve CPU compile time (slower code): for tests and short runs.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.lru_cache(maxsize=16)
def _compiled(st: Shapes, spec: bool, options: tuple):
  gen = generate_spec if spec else generate_plain
  return jax.jit(functools.partial(gen, st), compiler_options=dict(options) or None)


@functools.lru_cache(maxsize=16)
def _compiled_queue(st: Shapes, slots: int, options: tuple):
  return jax.jit(functools.partial(generate_continuous, st, slots=slots), compiler_options=dict(options) or None)


@functools.lru_cache(maxsize=16)
def _compiled_call(args, options: tuple, quantize=None):
  return jax.jit(
    lambda v, *xs: model_call(args, cast_variables(v, args.dtype, quantize), *xs),
    compiler_options=dict(options) or None,
  )


# ----------------------------------------------------------------------------------------------------------------


class RolloutEngine:
  """Batched KV-cached generation (see the module docstring). The caller repeats prompts for N responses each.

  model_cfg: ConfigDict or ModelArgs of the trained model; the engine runs it in its own `dtype`.
  max_prompt_len P: prompts narrower than P are left-padded to P (one compilation per batch size).
  temperature 0 = greedy; top_p 1 = plain sampling; logit_noise = std of Gaussian noise added to the logits.
  spec_decode: MTP-K draft + verify (needs num_mtp_layers >= 1); same output distribution, fewer model calls.
  quantize: None, "int8" or "fp8": weight-only quantized matrices, per output channel (sampling/quantize.py).
  stop_ids: more tokens that end a response like EOS (e.g. the tool-call end of a multi-turn turn); a response
  ending in one of them is not "truncated".
  compiler_options: XLA options for jax.jit, e.g. FAST_COMPILE (tests, short CPU runs).
  Engines that differ only in eos/pad ids and sampling settings share one compiled program (`plain.Sampling`: traced).
  """

  def __init__(
    self,
    model_cfg,
    *,
    max_prompt_len,
    max_new_tokens,
    eos_id,
    pad_id,
    dtype="bfloat16",
    temperature=1.0,
    top_p=1.0,
    logit_noise=0.0,
    spec_decode=False,
    compiler_options=None,
    quantize=None,
    stop_ids=(),
  ):
    base = M.as_args(model_cfg)
    for name, val in (("max_prompt_len", max_prompt_len), ("max_new_tokens", max_new_tokens)):
      if int(val) < 1:
        raise ValueError(f"{name} must be >= 1, got {val}")
    stop_ids = tuple(int(t) for t in stop_ids)
    for name, val in (("eos_id", eos_id), ("pad_id", pad_id)) + tuple(("stop_ids", t) for t in stop_ids):
      if not 0 <= int(val) < base.vocab_size:
        raise ValueError(f"{name} must lie in [0, vocab_size={base.vocab_size}), got {val}")
    if dtype not in ENGINE_DTYPES:
      raise ValueError(f"dtype must be one of {ENGINE_DTYPES}, got {dtype!r}")
    if temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
      raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if logit_noise < 0:
      raise ValueError(f"logit_noise must be >= 0, got {logit_noise}")
    if quantize is not None and quantize not in QUANT_FORMATS:
      raise ValueError(f"quantize must be None or one of {tuple(QUANT_FORMATS)}, got {quantize!r}")
    if spec_decode and not base.mtp_layers:
      raise ValueError("spec_decode needs MTP modules: model config field 'num_mtp_layers' is 0")
    self.args = dataclasses.replace(base, dtype=jnp.dtype(dtype))
    self.max_prompt_len, self.max_new_tokens = int(max_prompt_len), int(max_new_tokens)
    self.eos_id, self.pad_id, self.dtype, self.spec_decode = int(eos_id), int(pad_id), dtype, bool(spec_decode)
    self.temperature, self.top_p, self.logit_noise = float(temperature), float(top_p), float(logit_noise)
    self.quantize, self.stop_ids = quantize, stop_ids
    self._shapes = Shapes(self.args, self.max_prompt_len, self.max_new_tokens, quantize)
    self._options = tuple(sorted((compiler_options or {}).items()))

  @property
  def sampling(self) -> Sampling:
    f32, i32 = (lambda x: jnp.asarray(x, jnp.float32)), (lambda x: jnp.asarray(x, jnp.int32))
    stop = i32((self.eos_id,) + self.stop_ids)
    return Sampling(f32(self.temperature), f32(self.top_p), f32(self.logit_noise), stop, i32(self.pad_id))

  def generate(self, variables, prompts, prompt_lens, rng) -> dict:
    """prompts int [B, P'] (P' <= max_prompt_len) left-padded with pad_id, prompt_lens int [B] -> output dict."""
    prompts, lens = self._inputs(prompts, prompt_lens)
    return _compiled(self._shapes, self.spec_decode, self._options)(variables, prompts, lens, self.sampling, rng)

  def generate_queue(self, variables, prompts, prompt_lens, rng, slots: int, limits=None) -> dict:
    """Continuous batching (sampling/continuous.py): `slots` decode rows serve the Q prompts [Q, P'] in order; a
    finished row takes the next prompt. limits int [Q] in [1, max_new_tokens]: each response's token budget
    (default max_new_tokens). Request q's tokens equal `generate` of it alone with the key fold_in(rng, q)."""
    prompts, lens = self._inputs(prompts, prompt_lens)
    Q, N = prompts.shape[0], self.max_new_tokens
    if self.spec_decode:
      raise ValueError("generate_queue: continuous batching decodes one token per step (spec_decode must be off)")
    if not is_int(slots) or not 1 <= slots <= Q:
      raise ValueError(f"generate_queue: slots must be an int in [1, {Q}] (the number of prompts), got {slots!r}")
    limits = jnp.full((Q,), N, jnp.int32) if limits is None else jnp.asarray(limits)
    if limits.shape != (Q,) or not jnp.issubdtype(limits.dtype, jnp.integer):
      raise ValueError(f"generate_queue: limits must be an integer array [Q={Q}], got {limits.dtype} {limits.shape}")
    if int(limits.min()) < 1 or int(limits.max()) > N:
      raise ValueError(f"generate_queue: limits must lie in [1, {N}] (max_new_tokens), got {limits.tolist()}")
    fn = _compiled_queue(self._shapes, slots, self._options)
    return fn(variables, prompts, lens, limits.astype(jnp.int32), self.sampling, rng)

  def _inputs(self, prompts, prompt_lens):
    """Checked prompts (left-padded to max_prompt_len, int32) and lengths (int32)."""
    prompts, lens = jnp.asarray(prompts), jnp.asarray(prompt_lens)
    if prompts.ndim != 2 or not jnp.issubdtype(prompts.dtype, jnp.integer):
      raise ValueError(f"prompts must be an integer array [B, P], got {prompts.dtype} {prompts.shape}")
    B, Pw = prompts.shape
    if Pw > self.max_prompt_len:
      raise ValueError(f"prompts has width {Pw} > max_prompt_len={self.max_prompt_len} (shape {prompts.shape})")
    if lens.shape != (B,) or not jnp.issubdtype(lens.dtype, jnp.integer):
      raise ValueError(f"prompt_lens must be an integer array [B={B}], got {lens.dtype} {lens.shape}")
    try:
      ln = np.asarray(lens)
    except jax.errors.TracerArrayConversionError:
      ln = None
    if ln is not None and (ln.min() < 1 or ln.max() > Pw):
      raise ValueError(f"prompt_lens must lie in [1, {Pw}] (prompts shape {prompts.shape}), got {ln.tolist()}")
    prompts = jnp.pad(prompts.astype(jnp.int32), ((0, 0), (self.max_prompt_len - Pw, 0)), constant_values=self.pad_id)
    return prompts, lens.astype(jnp.int32)

  # Low-level pieces (tests, benchmarks): the exact cached call generate() uses, in the engine's dtype.
  def init_cache(self, batch, length, lookahead=0, mtp=False):
    return init_cache(self.args, batch, length, lookahead, mtp=mtp)

  def model_call(self, variables, tokens, positions, segment_ids, cache, cache_index):
    """-> (logits [B, T, V] fp32, hidden [B, T, H], new cache, {MoE layer: routing confidence}, valid tokens)."""
    call = _compiled_call(self.args, self._options, self.quantize)
    return call(variables, tokens, positions, segment_ids, cache, cache_index)
