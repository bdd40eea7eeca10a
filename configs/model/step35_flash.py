"""The published Step 3.5 Flash (docs/architecture.md): 45 layers + MTP-3, hidden 4096, 64/96 query heads over 8
KV heads, 288 experts top-8 (+1 shared), window 512, vocab 128,896, bf16 weights.
  python experiments/count_params.py --config=configs/model/step35_flash.py     # a few seconds, no weights
"""

from stepflash_jax.config import model_config


def get_config(arg=None):
  return model_config(dtype="bfloat16", param_dtype="bfloat16", remat=True)
