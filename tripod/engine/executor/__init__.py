"""The executor: one model over several processes, the way vLLM splits executor and worker.

- ``group``: ``WorkerGroup`` (ranks 1..N-1 as rank 0 sees them), the ``RankStep`` it sends each
  forward, joining the torch.distributed group, and the faults (``WorkerLost``);
- ``local``: the workers as processes spawned on this machine (``LocalWorkers``);
- ``ray_group``: the workers as Ray actors placed over a cluster (``RayWorkers``);
- ``worker``: what a rank > 0 runs (``RankWorker``: its shard, its pool, each step's forward).

Rank 0 is the engine itself (``engine/builder.py`` makes the group); nothing here imports it.
"""
