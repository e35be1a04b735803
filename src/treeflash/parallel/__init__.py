"""Tensor and expert parallelism on torch.distributed (NCCL on GPUs, gloo on CPU).

`treeflash.sharding.Parallel` (below the models, which take it by value) says which heads /
intermediate slice / experts a rank holds and runs the model's all-reduce; this package starts
the group and runs the steps on it:

  launch.py    start the group (spawned followers or torchrun), timeouts, `DistributedError`
  protocol.py  the step messages rank 0 broadcasts: fixed int64 header, then tensors; no pickle
  executor.py  `DistributedExecutor`: the engine's executor seam on rank 0
  worker.py    the follower loop: load the shard, run each announced step, exit on SHUTDOWN
  watch.py     rank 0's watch on its spawned followers: one that exits aborts the group
  stats.py     MoE load per expert and per rank (max/mean) for doctor and bench sweep

How it is split (`LLM(..., tp=N, ep=M)`, `--tp N --ep M`):
- Attention: heads split over the N ranks (q_proj / q_b_proj and kv_b_proj rows, o_proj
  columns); q_a / kv_a projections and their norms are replicated, so every rank writes the
  same whole latent cache and reads it for its own heads (as SGLang / vLLM do for MLA: the
  cache is replicated N times). o_proj is row-parallel: one all-reduce per layer, and only
  rank 0 holds its bias, so the sum adds it once.
- Dense MLP and shared experts: gate/up column-split, down row-split; routed experts: M
  expert-parallel groups own E/M experts each, and the N/M ranks of a group split each
  owned expert's intermediate dim (M=1: pure TP, M=N: pure EP). The router is replicated,
  every rank routes every token and computes only its part; attention output and MLP/MoE
  output are each one all-reduce per layer.
- Embedding and lm_head: replicated, so hidden states, taps and logits are whole on rank 0
  with no extra communication, and the drafter can share them. The cost: rank 0 reads the
  whole lm_head each step (DeepSeek-V3: 129280 x 7168 bf16 = 1.85 GB, ~0.45 ms at 4.2 TB/s),
  where vocab-parallel would read 1/N of it and gather [T, V/N] logits. Worth measuring on
  the multi-GPU run (issue 9) before changing.
- The drafter runs on rank 0 only, replicated nowhere else: it reads rank 0's taps and
  the (replicated) embedding and lm_head; followers never see it.
- The loader reads only each rank's slices (safetensors `get_slice`; FP8 on whole scale
  blocks, trimmed after dequantisation) and skips the experts a rank does not own.

How it runs: rank 0 owns the scheduler, the KV allocator and the server. Each forward or
commit is broadcast as a schema-checked message (page tables included: every rank has a
pool of the same geometry and uses rank 0's page ids), then every rank runs its shard.
A rank that dies closes its sockets, so a gloo collective fails at once; an NCCL one would
wait for the watchdog's timeout, so rank 0 watches the followers it spawned and aborts the
groups (`_abort_process_group`) as soon as one exits, which ends the collective in flight
and names that rank as the cause (under torchrun, torchrun's agent ends the group). A rank
that hangs fails rank 0's next collective after TREEFLASH_DIST_TIMEOUT seconds (default
600); either way rank 0 raises `DistributedError` naming the rank (and its exit code or
signal when it spawned it), kills the followers it started and leaves the group. A follower whose own
step raised (out of memory, a bug) leaves its exception and traceback in the group's
TCPStore before exiting; rank 0 then names it ("rank 1 (pid p) raised OutOfMemoryError: ...")
and prints the traceback, instead of reporting a lost connection. Followers exit when
rank 0 goes away (lost connection, or their parent process is gone).

Decode context parallelism (`LLM(..., tp=N, dcp=M)`, `--dcp M`, M divides N): the N-fold cache
replication above is cut to N/M-fold. Groups of M consecutive ranks deal each request's pages
among themselves (a page id holds M x page_size positions of a request, page_size on each rank),
each rank attends with its group's heads over its share, and one all-to-all a layer hands each
rank its heads' partials, merged by log-sum-exp (`models/dcp.py` says how,
rows and commits included; `group.py` makes the groups).
Defragmentation moves the followers' pages too (MOVE steps). Followers keep an unused lm_head.
"""
