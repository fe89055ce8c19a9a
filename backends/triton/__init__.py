"""``triton`` backend: the shared transformer with fused Triton KV-cache kernels on CUDA.

``backend.py`` registers it (``TritonBackend``); ``runner.py`` holds the runner
(``TritonRunner``), which composes the reference pieces of :mod:`localmoe.backends.reference`
with its own KV-write and decode-attention ops.
"""

from localmoe.backends.triton.backend import TritonBackend  # noqa: F401  (registers "triton")
from localmoe.backends.triton.runner import TritonRunner  # noqa: F401
