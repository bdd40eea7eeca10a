"""TPU (Mosaic) kernel bodies; they also run in Pallas' interpreter on CPU.

  attention.py       sliding-window GQA flash attention: forward, dq, dk/dv (scalar-prefetched block-pair grid)
  grouped_matmul.py  gmm / tgmm over scalar-prefetched visit lists
The public entries (pallas_kernels/sliding_window_attention.py, grouped_matmul.py) pick them through
pallas_kernels.common.kernel_target and differentiate them through pallas_kernels.vjp.
"""
