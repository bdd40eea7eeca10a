"""Tiny Hugging Face-layout checkpoints made locally (docs/data.md §4): what a real Step 3.5 Flash directory holds, at
toy size, with nothing downloaded.

make_fixture(dir) writes
    tokenizer.json          byte-level BPE trained here with the `tokenizers` library on chat-rendered task text
    tokenizer_config.json   eos <|im_end|>, pad <|endoftext|> (id 0), the chat template data/templates/step35.jinja
    config.json + model.safetensors   a random tiny Step3p5 (save_hf_checkpoint), vocab = the tokenizer's
    prompts.jsonl           `num_prompts` records in the data/jsonl.py schema (arithmetic, verifier "numeric"),
                            the last fifth of them the held-out split
  python experiments/make_fixture.py --out /tmp/tiny_step   # ~10 s
"""

from __future__ import annotations

import json
import os

import jax
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from stepflash_jax import config as config_lib
from stepflash_jax import model as model_lib
from stepflash_jax.data import tasks
from stepflash_jax.data.hf_tokenizer import CONFIG_FILE, TOKENIZER_FILE, HFTokenizer, compile_template, split_answer
from stepflash_jax.files import atomic_write
from stepflash_jax.hf import save_hf_checkpoint

TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "data", "templates", "step35.jinja")
PAD, BOS, EOS, IM_START = "<|endoftext|>", "<|begin_of_text|>", "<|im_end|>", "<|im_start|>"
# One token each, as in the released vocabulary: turn markers, the reasoning span, the XML tool-call tags.
SPECIAL_TOKENS = [PAD, BOS, IM_START, EOS, "<think>", "</think>", "<tool_call>", "</tool_call>"]
SPECIAL_TOKENS += ["<tool_response>", "</tool_response>"]
FIXTURE_MIXTURE = "arithmetic/+:2-3,arithmetic/-:2"  # the prompts.jsonl problems


def chat_template() -> str:
  with open(TEMPLATE_PATH) as f:
    return f.read()


def corpus(examples: int = 400, seed: int = 0) -> list[str]:
  """Chat-rendered task conversations (default mixture) and a tool-call turn: the BPE training text."""
  render = compile_template(chat_template())
  lines = []
  for i in range(examples):
    ex = tasks.sample_example(tasks.DEFAULT_MIXTURE, seed, i, "train")
    msgs = [{"role": "user", "content": ex["prompt"]}, split_answer(ex["answer"])]
    lines.append(render.render(messages=msgs, add_generation_prompt=False, tools=None))
  call = {"name": "calc", "arguments": {"expression": "12 * 7"}}
  tool_msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
  lines.append(render.render(messages=tool_msgs + [{"role": "tool", "content": "84"}], add_generation_prompt=True))
  return lines


def train_hf_tokenizer(directory: str, vocab_size: int = 640, lines: list[str] | None = None) -> HFTokenizer:
  """Byte-level BPE (no normaliser, no prefix space: decode(encode(text)) == text) + tokenizer_config.json."""
  tk = Tokenizer(models.BPE())
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=SPECIAL_TOKENS,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tk.train_from_iterator(lines or corpus(), trainer=trainer)
  os.makedirs(directory, exist_ok=True)
  atomic_write(os.path.join(directory, TOKENIZER_FILE), tk.to_str())
  cfg = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": BOS,
    "eos_token": EOS,
    "pad_token": PAD,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 4096,
    "chat_template": chat_template(),
  }
  atomic_write(os.path.join(directory, CONFIG_FILE), json.dumps(cfg, indent=1))
  return HFTokenizer(directory)


def fixture_model_config(vocab_size: int):
  """A 4-layer Step3p5 (full, SWA, SWA, SWA; dense first, then MoE with 4 experts top-2) + 1 MTP module."""
  L, M = 4, 1
  types = [config_lib.FULL if i % 4 == 0 else config_lib.SWA for i in range(L + M)]
  return config_lib.model_config(
    vocab_size=vocab_size,
    hidden_size=64,
    head_dim=16,
    num_layers=L,
    num_mtp_layers=M,
    num_heads=4,
    num_heads_swa=4,
    num_kv_heads=2,
    sliding_window=16,
    layer_types=types,
    rope_theta=[5e6 if t == config_lib.FULL else 1e4 for t in types],
    partial_rotary_factors=[0.5 if t == config_lib.FULL else 1.0 for t in types],
    rope_scaling=dict(
      rope_type="llama3", factor=2.0, original_max_position_embeddings=64, low_freq_factor=1.0, high_freq_factor=4.0
    ),
    intermediate_size=128,
    moe_layers=list(range(1, L)),
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    swiglu_limits=[0.0] * (L + M),
    swiglu_limits_shared=[0.0] * (L + M),
    max_position_embeddings=1024,
    scan_layers=False,
  )


def write_prompts(path: str, num: int = 50, seed: int = 0, mixture: str = FIXTURE_MIXTURE) -> str:
  """`num` JSONL records (prompt, reference = the final answer, verifier "numeric", response = the worked answer);
  the last num // 5 are test-split problems marked "split": "test" (the held-out set)."""
  mix, rows = tasks.parse_mixture(mixture), []
  for i in range(num):
    split = "test" if i >= num - num // 5 else "train"
    ex = tasks.sample_example(mix, seed, i, split)
    final = ex["answer"].rsplit("</think>", 1)[-1]
    row = {"prompt": ex["prompt"], "reference": final, "verifier": "numeric", "response": ex["answer"]}
    rows.append({**row, "split": split})
  atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows))
  return path


def make_fixture(directory: str, *, seed: int = 0, num_prompts: int = 50) -> str:
  """Tokenizer, random tiny checkpoint and prompts.jsonl in `directory` (see the module docstring)."""
  tok = train_hf_tokenizer(directory)
  cfg = fixture_model_config(tok.vocab_size)
  variables = model_lib.init(model_lib.as_args(cfg), jax.random.key(seed))
  save_hf_checkpoint(cfg, variables, directory)
  write_prompts(os.path.join(directory, "prompts.jsonl"), num_prompts, seed)
  return directory
