"""The NF4 format's constants, shared by the linear layer (`nf4.py`) and its kernels."""
import torch

BLOCK = 64  # elements per absmax
# The NF4 code book (bitsandbytes' `get_4bit_type("nf4")`): quantiles of N(0, 1) scaled to [-1, 1].
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
], dtype=torch.float32)
