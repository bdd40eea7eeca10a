"""A tiny Hugging Face-layout Step3p5 checkpoint made locally (stepflash_jax/fixtures.py): tokenizer.json,
tokenizer_config.json with a chat template of the released model's shape, random weights, and prompts.jsonl.

  python experiments/make_fixture.py --out runs/fixture      # ~10 s on 2 cores
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="output directory (created)")
  p.add_argument("--seed", type=int, default=0, help="weights and prompts")
  p.add_argument("--num_prompts", type=int, default=50, help="records in prompts.jsonl")
  a = p.parse_args()
  if a.num_prompts < 1:
    p.error("--num_prompts must be >= 1")
  from stepflash_jax.fixtures import make_fixture

  print(f"wrote {make_fixture(a.out, seed=a.seed, num_prompts=a.num_prompts)}")


if __name__ == "__main__":
  main()
