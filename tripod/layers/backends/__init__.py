"""The compute backends behind one interface (``layers/batch.Backend``, beside the
``ForwardBatch`` it builds and reads): what a forward pass computes with.

A layer asks its backend for each op family and knows nothing of ISAs or kernels:

- ``linear(weight, bias, ...)``: a projection prepared once in the backend's own weight layout;
- ``norm`` (RMSNorm), ``activate`` (act(gate) * up);
- ``attend``: RoPE, the KV write and paged attention over the pool;
- ``build_batch``: a step's work laid out with the attention metadata the backend reads, from
  the model runner's ``BatchContext`` (device, decode mirror, slot table).

Backends:

- ``ReferenceBackend``: torch, float32-exact (op for op with Hugging Face): ``F.linear``, SDPA;
  what ``--kernels eager`` (and ``--dtype float32`` under ``auto``) runs, on any device.
- ``TorchBackend``: torch's ops with projections packed once for oneDNN: what serves while
  tripod's kernels build, or where none can run (``reason`` says why).
- ``CpuBackend``: tripod's C++ kernels of one ISA level (``tripod.kernels``), reading the pool
  through the slot table. Every level computes the same bits.
- ``CpuLinearBackend``: the kernels for projections, norms and SiLU·mul with torch's attention,
  for models whose attention the kernels do not cover (sliding windows, soft-caps, MLA).
- ``TritonBackend`` / ``TritonLinearBackend`` (``backends/triton.py``): the Triton kernels
  (``tripod.kernels.gpu``): what ``--device cuda`` runs, with decode CUDA graphs
  (``engine/graphs.py``); on the CPU only in Triton's interpreter (tests).

Switching a runner to the kernels mid-serve is one object swapped: once they load, the runner's
``backend`` hands out its ``CpuBackend`` instead of the ``TorchBackend``; no layer changes.
"""

from __future__ import annotations

from tripod.layers.backends.cpu import CpuBackend, CpuLinearBackend
from tripod.layers.backends.reference import REFERENCE, ReferenceBackend, TorchBackend

__all__ = ["REFERENCE", "CpuBackend", "CpuLinearBackend", "ReferenceBackend", "TorchBackend"]
