"""Data: verifiable task families (tasks/), the SentencePiece tokenizer + chat template, grain pipelines."""

from stepflash_jax.data import tasks
from stepflash_jax.data.pipeline import example_dataset, future_targets, pad_prompts, prompt_dataset, sft_dataset
from stepflash_jax.data.tokenizer import Tokenizer, load_tokenizer, train_tokenizer

__all__ = [
  "Tokenizer",
  "example_dataset",
  "future_targets",
  "load_tokenizer",
  "pad_prompts",
  "prompt_dataset",
  "sft_dataset",
  "tasks",
  "train_tokenizer",
]
