"""The FP8 formats the kernels take and the scaling block, without Triton (the PyTorch side reads
them too): E4M3 and E5M2 by id (the kernels' ``FMT`` constexpr), each format's largest finite
value, and the 128 values of one scaling block."""

FP8_E4M3, FP8_E5M2 = 0, 1
FP8_MAX = {FP8_E4M3: 448.0, FP8_E5M2: 57344.0}
FP8_BLOCK = 128
