"""Tensor and expert parallelism on torch.distributed (NCCL on GPUs, gloo on CPU).

  parallel.py  `Parallel`: which heads / intermediate slice / experts a rank holds; all-reduce
  launch.py    start the group (spawned followers or torchrun), timeouts, `DistributedError`
  protocol.py  the step messages rank 0 broadcasts: fixed int64 header, then tensors; no pickle
  executor.py  `DistributedExecutor`: the engine's executor seam on rank 0
  worker.py    the follower loop: load the shard, run each announced step, exit on SHUTDOWN
  stats.py     MoE load per expert and per rank (max/mean) for doctor and bench sweep
"""
