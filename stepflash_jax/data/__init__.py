"""Data: verifiable task families (tasks/), user JSONL prompts (jsonl.py, verifiers.py), the SentencePiece tokenizer
+ chat template and Hugging Face tokenizers (hf_tokenizer.py), grain pipelines."""

from stepflash_jax.data import jsonl, tasks, verifiers
from stepflash_jax.data.hf_tokenizer import HFTokenizer, load_tokenizer_dir, tokenizer_for
from stepflash_jax.data.pipeline import (
  example_dataset,
  future_targets,
  pad_prompts,
  padded_chunk,
  prompt_dataset,
  sft_dataset,
)
from stepflash_jax.data.tokenizer import Tokenizer, load_tokenizer, train_tokenizer

__all__ = [
  "HFTokenizer",
  "Tokenizer",
  "example_dataset",
  "future_targets",
  "jsonl",
  "load_tokenizer_dir",
  "load_tokenizer",
  "pad_prompts",
  "padded_chunk",
  "prompt_dataset",
  "sft_dataset",
  "tasks",
  "tokenizer_for",
  "train_tokenizer",
  "verifiers",
]
