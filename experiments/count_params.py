"""Parameter counts from abstract shapes (jax.eval_shape: no weights are allocated).

  python experiments/count_params.py --config=configs/model/step35_flash.py
prints JSON {"total", "total_with_embeddings", "active", "mtp"} (docs/architecture.md §7: 195.9B / 196.96B /
10.93B / ~0.84B):
total = backbone without embedding and lm_head; active = per token (top-k routed + shared experts of each MoE
layer, everything else, no embedding/lm_head); mtp = the MTP modules without their output heads.
"""

import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
from absl import app
from ml_collections import config_flags

from stepflash_jax import model as model_lib


def count(cfg) -> dict:
  args = model_lib.as_args(cfg)
  params = model_lib.abstract_variables(args)["params"]
  n = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
  backbone = {k: v for k, v in params.items() if not k.startswith("mtp_") and k not in ("embed", "lm_head")}
  keys = lambda path: [getattr(k, "key", None) for k in path]
  routed = sum(
    math.prod(x.shape)
    for path, x in jax.tree_util.tree_flatten_with_path(backbone)[0]
    if "moe" in keys(path) and "shared" not in keys(path) and "router" not in keys(path)
  )
  total = n(backbone)
  mtp = sum(n({k: v for k, v in params[m].items() if k != "head"}) for m in params if m.startswith("mtp_"))
  return {
    "total": total,
    "total_with_embeddings": total + n(params["embed"]) + n(params["lm_head"]),
    "active": total - routed + routed * args.top_k // args.num_experts,
    "mtp": mtp,
    "mtp_with_heads": sum(n(params[m]) for m in params if m.startswith("mtp_")),
  }


_CONFIG = config_flags.DEFINE_config_file("config", "configs/model/step35_flash.py", "model config file")


def main(_):
  t = time.time()
  out = count(_CONFIG.value)
  out["seconds"] = round(time.time() - t, 2)
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
