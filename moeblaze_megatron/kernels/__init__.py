"""Triton kernels. Each module holds a kernel, its launcher and (where it has one) its autograd
Function; the pure-PyTorch reference of each lives beside the public op it serves."""
