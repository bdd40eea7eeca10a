"""Pallas kernels of the two non-trivial ops (docs/kernels.md). Imports point down this list; nothing here imports
stepflash_jax (whose ops import these modules):

  sliding_window_attention.py, grouped_matmul.py   public entries: check arguments, pick where to run
  gpu/__init__.py                                  GPU entries forcing the Triton kernels, XLA fallbacks
  vjp.py                                           custom_vjp wiring; the static config names the kernel module
  tpu/attention.py, tpu/grouped_matmul.py          Mosaic kernel bodies (also run interpreted on CPU)
  gpu/attention.py, gpu/grouped_matmul.py          Triton kernel bodies
  reference.py                                     dense references (the semantics every implementation reproduces)
  common.py                                        dot dims, padding, block/visit lists, kernel_target, argument checks
  masks.py                                         the visibility rule and MASK_VALUE
"""
