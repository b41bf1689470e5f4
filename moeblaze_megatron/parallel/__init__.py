"""Token exchange across expert-parallel ranks, framework-neutral (a torch.distributed group in,
tensors out): ``alltoall`` sends each token once per destination rank."""
