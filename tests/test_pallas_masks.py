"""The one visibility rule (pallas_kernels/masks.py): its definition, and its masked-score value written once.

Every attention (kernels, references, ops' banded path, the model's cached attention) builds its mask with
`masks.visible`; the numerics tests of each check that they agree with the reference.
"""

import pathlib

import numpy as np

from pallas_kernels import masks

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_visibility_rule_is_its_definition():
  pos = range(-1, 7)  # -1: an empty key slot (KV cache) / front padding
  seg = np.array([0, 0, 0, 1, 1, 1, 1, 2])
  p = np.asarray(pos)
  for window in (None, 1, 3):
    for empty in (False, True):
      got = masks.visible(p[:, None], p[None, :], window, seg[:, None], seg[None, :], empty_keys=empty)
      want = [
        [
          j <= i and (window is None or i - j < window) and seg[a] == seg[b] and not (empty and j < 0)
          for b, j in enumerate(pos)
        ]
        for a, i in enumerate(pos)
      ]
      np.testing.assert_array_equal(got, np.array(want), err_msg=f"window={window} empty_keys={empty}")


def test_dense_mask_is_the_rule_on_positions():
  seg = np.array([[0, 0, 1, 1, 1, 2]])
  i, j = np.arange(6)[:, None], np.arange(6)[None, :]
  want = (j <= i) & (i - j < 2) & (seg[0][:, None] == seg[0][None, :])
  np.testing.assert_array_equal(np.asarray(masks.attention_mask(6, 2, seg))[0], want)


def test_the_masked_score_value_is_written_once():
  attention = ["pallas_kernels", "stepflash_jax/ops", "stepflash_jax/model/attention.py"]
  files = [p for a in attention for p in ((ROOT / a).rglob("*.py") if (ROOT / a).is_dir() else [ROOT / a])]
  written = sorted(str(p.relative_to(ROOT)) for p in files if "1e30" in p.read_text())
  assert written == ["pallas_kernels/masks.py"]
