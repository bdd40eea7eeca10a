"""Shared helpers of the verifiable task families: seeding, the train/test split, answer extraction.

Every family module (arithmetic.py, countdown.py, ...) exposes

    FAMILY: str                      the registry name, also stored in each example["family"]
    DIFFICULTIES: tuple[int, ...]    the valid difficulty levels
    VARIANTS: tuple[str | None, ...] optional sub-kinds (e.g. the arithmetic operator); None = family default
    generate(seed, difficulty, split="train", variant=None) -> example dict
    check(example_or_metadata, completion) -> bool
    canonical(metadata) -> str      the canonical problem string hashed by `split_of`

An example is dict(prompt: str, answer: str, family: str, difficulty: int, metadata: dict). `answer` is the
reference completion used as the SFT target: "<think>short reasoning</think>final answer". `metadata` holds
everything the checker needs (plain ints / strings / lists, so it is cheap to carry through a pipeline).

Split: a problem belongs to the held-out split iff sha256(canonical problem) mod 1000 < 1000 * TEST_FRACTION.
Generators draw problems until they hit one of the requested split, so train and test are disjoint by
construction (for every family, difficulty and seed).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Mapping

from stepflash_jax.checks import is_int

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TEST_FRACTION = 0.1
SPLITS = ("train", "test")
MAX_REJECTION_TRIES = 100_000


def derive_seed(*parts: Any) -> int:
  """A 64-bit seed from arbitrary printable parts (stable across processes and Python versions)."""
  digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
  return int.from_bytes(digest[:8], "little")


def split_of(canonical_problem: str) -> str:
  """'test' for ~TEST_FRACTION of canonical problems (by hash), 'train' otherwise."""
  h = int.from_bytes(hashlib.sha256(canonical_problem.encode()).digest()[:8], "little")
  return "test" if h % 1000 < int(round(1000 * TEST_FRACTION)) else "train"


def check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def check_difficulty(difficulty: Any, allowed: tuple[int, ...], family: str) -> int:
  if not is_int(difficulty) or difficulty not in allowed:
    raise ValueError(f"difficulty for {family!r} must be an int in {allowed[0]}..{allowed[-1]}, got {difficulty!r}")
  return int(difficulty)  # a numpy int becomes a Python int (examples are written as JSON)


def rng_for(family: str, seed: int, difficulty: int, split: str, variant: Any) -> random.Random:
  """The generator's RNG: a pure function of (family, seed, difficulty, split, variant)."""
  if not is_int(seed):
    raise ValueError(f"seed must be an int, got {seed!r}")
  return random.Random(derive_seed(family, seed, difficulty, split, variant))


def generator_rng(family: str, difficulties, variants, seed, difficulty, split, variant) -> tuple[int, random.Random]:
  """A family's `generate` arguments checked against its DIFFICULTIES / VARIANTS -> (difficulty, its RNG)."""
  check_split(split)
  d = check_difficulty(difficulty, difficulties, family)
  if variant not in variants:
    raise ValueError(f"variant for {family!r} must be one of {variants}, got {variant!r}")
  return d, rng_for(family, seed, d, split, variant)


def metadata_of(example_or_metadata: Mapping[str, Any]) -> Mapping[str, Any]:
  """Accepts either a whole example (with a 'metadata' field) or the metadata dict itself."""
  if not isinstance(example_or_metadata, Mapping):
    raise ValueError(f"example_or_metadata must be a dict, got {type(example_or_metadata).__name__}")
  if "metadata" in example_or_metadata:
    return example_or_metadata["metadata"]
  return example_or_metadata


def extract_answer(completion: str) -> str | None:
  """The final answer of a completion: the text after the last '</think>', stripped.

  A completion that opens '<think>' but never closes it has no answer (None): its reasoning was cut off.
  A completion without any think span is taken whole. Anything after the first newline is ignored.
  """
  if not isinstance(completion, str):
    raise ValueError(f"completion must be a str, got {type(completion).__name__}")
  if THINK_CLOSE in completion:
    text = completion.rsplit(THINK_CLOSE, 1)[1]
  elif THINK_OPEN in completion:
    return None
  else:
    text = completion
  text = text.strip().split("\n", 1)[0].strip()
  return text or None


def think(body: str, final: str) -> str:
  """The SFT target format: '<think>body</think>final'."""
  return f"{THINK_OPEN}{body}{THINK_CLOSE}{final}"
