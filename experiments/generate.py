"""Generate with a Step 3.5 Flash checkpoint directory (HF layout): one answer to a prompt, or an interactive chat,
streamed to stdout as the tokens are produced.

    python experiments/generate.py --checkpoint DIR --prompt "What is 12 + 7?"     # one answer, then exit
    python experiments/generate.py --checkpoint DIR --system "Be brief."           # chat on stdin
    other flags: --temperature 0.7 (0 = greedy) --top_p 1.0 --max_new_tokens 256 --mtp --seed 0
                 --dtype float32|bfloat16 (the engine's compute dtype)

Chat: each line read after the "> " prompt is a user turn. The conversation (the assistant replies too, their
<think> reasoning as reasoning_content, split as data/hf_tokenizer.split_answer does) is kept and rendered with the
checkpoint's chat template every turn; "/reset" clears it, "/exit" or end of input quits. The answer text goes to
stdout, timings to stderr.

Plain decoding is a Python loop over the rollout engine's compiled pieces (RolloutEngine.init_cache / model_call):
one prefill call with the prompt, left-padded to a power-of-two width so later chat turns reuse compiled programs,
then one KV-cached call per token, sampled as the engine samples (sampling/sample.py: temperature, top-p; token i
drawn with the key fold_in(key(seed), i)). After each token the whole response so far is decoded and the new suffix
printed (a trailing incomplete UTF-8 character waits for its remaining bytes). --mtp runs MTP speculative decoding
(RolloutEngine(spec_decode=True).generate): one compiled call for the whole answer, so its output is printed per
call (all at once), not per token; under greedy decoding its ids equal plain decoding's.

Measured on the tiny fixture (python experiments/make_fixture.py --out /tmp/t, 2 CPU cores, 2026-12-02),
--prompt "What is 12 + 7?" --temperature 0 (22 prompt tokens), compiles included:
  --max_new_tokens 256: 5.5 s for the answer, first text after 3.0 s, ~9 s for the whole command (load 0.8 s);
  --max_new_tokens 256 --mtp: 8.1 s, all text at the end. A chat turn that crosses a power-of-two prompt width
  compiles the prefill / step again (~3 s).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from stepflash_jax.data.tasks.base import THINK_CLOSE, THINK_OPEN
from stepflash_jax.model import as_args
from stepflash_jax.sampling import ENGINE_DTYPES, RolloutEngine, cast_variables
from stepflash_jax.sampling.sample import draw, sampling_logprobs

MIN_WIDTH = 16  # smallest prefill width (prompts are left-padded to a power of two >= this)


@jax.jit
def _sample(rng, i, logits, temperature, top_p):
  """logits [B, V] -> token ids [B]: the engine's draw for token i (plain.generate_plain, no logit noise)."""
  _, ks = jax.random.split(jax.random.fold_in(rng, i))
  return draw(ks, sampling_logprobs(logits, temperature, top_p), temperature <= 0)[0]


def _check(temperature, top_p, max_new_tokens, dtype, prompt_ids, vocab_size) -> None:
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
  if int(max_new_tokens) < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if dtype not in ENGINE_DTYPES:
    raise ValueError(f"dtype must be one of {ENGINE_DTYPES}, got {dtype!r}")
  if not prompt_ids:
    raise ValueError("prompt_ids is empty: the prompt must have at least one token")
  bad = [t for t in prompt_ids if not 0 <= int(t) < vocab_size]
  if bad:
    raise ValueError(f"prompt_ids must lie in [0, vocab_size={vocab_size}), got {bad[:5]}")


def _budget(model_cfg, prompt_len: int, max_new_tokens: int) -> int:
  """Tokens that may be generated: max_new_tokens, cut so prompt + response fits max_position_embeddings."""
  limit = getattr(model_cfg, "max_position_embeddings", None)
  if limit is None:
    return int(max_new_tokens)
  if prompt_len >= limit:
    raise ValueError(
      f"the prompt has {prompt_len} tokens: it must be shorter than max_position_embeddings={limit} "
      "(shorten the prompt, or /reset the chat)"
    )
  return min(int(max_new_tokens), limit - prompt_len)


class _Stream:
  """Turns the growing response ids into text deltas for on_text (whole-response decode, suffix printed)."""

  def __init__(self, tok, on_text):
    self.tok, self.on_text, self.shown = tok, on_text, ""

  def update(self, ids, final: bool = False) -> None:
    if self.on_text is None:
      return
    text = self.tok.decode(ids)
    if not final:
      text = text.rstrip("\ufffd")  # an incomplete multi-byte character: wait for its next bytes
    delta = text[len(os.path.commonprefix([text, self.shown])) :]  # = text[len(shown):] when shown is a prefix
    if delta:
      self.on_text(delta)
    self.shown = text


def _plain(engine, variables, prompt_ids, n, rng, stream) -> list[int]:
  """Prefill + one cached model call per token (batch 1) -> generated ids (eos excluded)."""
  L = len(prompt_ids)
  W = engine.max_prompt_len
  pad = W - L
  col = np.arange(W)
  tokens = np.concatenate([np.full(pad, engine.pad_id), np.asarray(prompt_ids)]).astype(np.int32)[None]
  positions, segments = np.maximum(col - pad, 0)[None].astype(np.int32), (col >= pad)[None].astype(np.int32)
  logits, _, cache, *_ = engine.model_call(variables, tokens, positions, segments, engine.init_cache(1, W + n), 0)
  temp, top_p = jnp.float32(engine.temperature), jnp.float32(engine.top_p)
  out, one = [], np.ones((1, 1), np.int32)
  for i in range(n):
    if i:
      step = (np.asarray([[out[-1]]], np.int32), np.asarray([[L + i - 1]], np.int32), one)
      logits, _, cache, *_ = engine.model_call(variables, *step, cache, W + i - 1)
    tok = int(_sample(rng, i, logits[:, -1], temp, top_p)[0])
    if tok == engine.eos_id:
      break
    out.append(tok)
    stream.update(out)
  return out


def _speculative(engine, variables, prompt_ids, rng) -> list[int]:
  """One MTP speculative generate call -> generated ids (eos excluded)."""
  res = engine.generate(variables, np.asarray([prompt_ids], np.int32), np.asarray([len(prompt_ids)], np.int32), rng)
  resp = np.asarray(res["response"][0])[: int(res["lengths"][0])].tolist()
  return resp[: resp.index(engine.eos_id)] if engine.eos_id in resp else resp


def complete(
  model_cfg,
  variables,
  tok,
  prompt_ids: list[int],
  *,
  temperature: float,
  top_p: float,
  max_new_tokens: int,
  seed: int,
  dtype: str = "float32",
  mtp: bool = False,
  on_text=None,
) -> list[int]:
  """prompt_ids [P] -> generated ids [<= max_new_tokens] (eos excluded), calling on_text(delta: str) with each new
  piece of decoded text (plain decoding: per token; mtp: once). temperature 0 = greedy; mtp = MTP speculative
  decoding (same ids as plain under greedy). Raises ValueError naming the bad argument."""
  prompt_ids = [int(t) for t in prompt_ids]
  _check(temperature, top_p, max_new_tokens, dtype, prompt_ids, as_args(model_cfg).vocab_size)
  n = _budget(model_cfg, len(prompt_ids), max_new_tokens)
  engine = RolloutEngine(
    model_cfg,
    max_prompt_len=max(MIN_WIDTH, 1 << (len(prompt_ids) - 1).bit_length()),
    max_new_tokens=n,
    eos_id=tok.eos_id,
    pad_id=tok.pad_id,
    dtype=dtype,
    temperature=temperature,
    top_p=top_p,
    spec_decode=mtp,
  )
  variables = cast_variables(variables, jnp.dtype(dtype))  # once (the engine's per-call cast is then a no-op)
  stream, rng = _Stream(tok, on_text), jax.random.key(seed)
  if mtp:
    out = _speculative(engine, variables, prompt_ids, rng)
  else:
    out = _plain(engine, variables, prompt_ids, n, rng, stream)
  stream.update(out, final=True)
  return out


# ----------------------------------------------------------------------------------------------------------------
# Chat


def _for_render(messages) -> list[dict]:
  """HF-style messages (reasoning_content) -> agents/chat.py's (reasoning), for tokenizers without a template."""
  out = []
  for m in messages:
    m = dict(m)
    if "reasoning_content" in m:
      m["reasoning"] = m.pop("reasoning_content")
    out.append(m)
  return out


def chat_text(tok, messages) -> str:
  """The conversation rendered with the tokenizer's chat template, ending with the generation prompt."""
  if hasattr(tok, "apply_chat_template"):
    return tok.apply_chat_template(messages, add_generation_prompt=True)
  from stepflash_jax.agents.chat import render

  return render(_for_render(messages), add_generation_prompt=True)


def chat_prompt_ids(tok, messages) -> list[int]:
  """messages [{"role", "content"[, "reasoning_content"]}] -> prompt ids ready for the assistant's answer."""
  ids = tok.encode(chat_text(tok, messages))
  if not hasattr(tok, "apply_chat_template") and tok.bos_id is not None:
    ids = [tok.bos_id] + ids  # the SentencePiece format starts with bos (Tokenizer.format_prompt)
  return ids


def assistant_message(prompt_text: str, generated: str) -> dict:
  """The generated text as an assistant message. A prompt ending inside an open <think> (the generation prompt
  "<|im_start|>assistant\\n<think>\\n") continues it: "R\\n</think>\\nC" -> reasoning_content R, content C. An
  unclosed reasoning span (truncated answer) is all reasoning."""
  head, opened, tail = prompt_text.rpartition(THINK_OPEN)
  answer = THINK_OPEN + tail + generated if opened and THINK_CLOSE not in tail else generated
  if not answer.startswith(THINK_OPEN):
    return {"role": "assistant", "content": answer}
  reasoning, closed, content = answer[len(THINK_OPEN) :].partition(THINK_CLOSE)
  content = content[1:] if content.startswith("\n") else content  # the template writes "\n</think>\n" + content
  return {"role": "assistant", "reasoning_content": reasoning.strip("\n"), "content": content if closed else ""}


# ----------------------------------------------------------------------------------------------------------------
# CLI


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--checkpoint", required=True, help="HF-layout directory: config.json, *.safetensors, tokenizer")
  p.add_argument("--prompt", default=None, help="answer this prompt and exit (default: interactive chat)")
  p.add_argument("--system", default=None, help="system message")
  p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
  p.add_argument("--top_p", type=float, default=1.0)
  p.add_argument("--max_new_tokens", type=int, default=256)
  p.add_argument("--mtp", action="store_true", help="MTP speculative decoding (printed per call, not per token)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default="float32", choices=ENGINE_DTYPES)
  a = p.parse_args(argv)
  if not os.path.isdir(a.checkpoint):
    p.error(f"--checkpoint {a.checkpoint!r} is not a directory")
  if a.temperature < 0:
    p.error(f"--temperature must be >= 0 (0 = greedy), got {a.temperature}")
  if not 0 < a.top_p <= 1:
    p.error(f"--top_p must lie in (0, 1], got {a.top_p}")
  if a.max_new_tokens < 1:
    p.error(f"--max_new_tokens must be >= 1, got {a.max_new_tokens}")
  if a.prompt is not None and not a.prompt.strip():
    p.error("--prompt must not be empty")
  return a


def _answer(a, model, tok, messages) -> dict:
  """Generate, stream and time one assistant turn for `messages` -> the assistant message."""
  text = chat_text(tok, messages)
  ids = chat_prompt_ids(tok, messages)
  t0, first = time.perf_counter(), []

  def show(delta: str) -> None:
    first.append(first[0] if first else time.perf_counter() - t0)
    print(delta, end="", flush=True)

  out = complete(
    *model,
    tok,
    ids,
    temperature=a.temperature,
    top_p=a.top_p,
    max_new_tokens=a.max_new_tokens,
    seed=a.seed,
    dtype=a.dtype,
    mtp=a.mtp,
    on_text=show,
  )
  dt = time.perf_counter() - t0
  print(flush=True)
  ttft = f", first text after {first[0]:.2f} s" if first else ""
  print(f"[{len(ids)} prompt + {len(out)} new tokens in {dt:.2f} s{ttft}]", file=sys.stderr, flush=True)
  return assistant_message(text, tok.decode(out))


def chat(a, model, tok) -> None:
  """The interactive loop: user lines from stdin until EOF or /exit; /reset clears the conversation."""
  base = [{"role": "system", "content": a.system}] if a.system else []
  messages = list(base)
  while True:
    try:
      line = input("> ")
    except EOFError:
      print(flush=True)
      return
    line = line.strip()
    if line == "/exit":
      return
    if line == "/reset":
      messages = list(base)
      print("(conversation cleared)", flush=True)
      continue
    if not line:
      continue
    try:
      reply = _answer(a, model, tok, messages + [{"role": "user", "content": line}])
    except ValueError as e:  # e.g. the conversation outgrew max_position_embeddings
      print(f"error: {e}", file=sys.stderr, flush=True)
      continue
    messages += [{"role": "user", "content": line}, reply]


def main(argv=None) -> int:
  a = parse_args(argv)
  from stepflash_jax import load_hf_checkpoint
  from stepflash_jax.data.hf_tokenizer import load_tokenizer_dir

  t0 = time.perf_counter()
  tok = load_tokenizer_dir(a.checkpoint)
  model = load_hf_checkpoint(a.checkpoint)
  print(f"[loaded {a.checkpoint} in {time.perf_counter() - t0:.2f} s]", file=sys.stderr, flush=True)
  if a.prompt is not None:
    base = [{"role": "system", "content": a.system}] if a.system else []
    _answer(a, model, tok, base + [{"role": "user", "content": a.prompt}])
  else:
    chat(a, model, tok)
  return 0


if __name__ == "__main__":
  sys.exit(main())
