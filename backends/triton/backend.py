"""Registration of the ``triton`` backend (fused GPU path) with the backend registry."""

from __future__ import annotations

from typing import Any

from localmoe.backends.reference import torch_supports
from localmoe.backends.registry import Backend, register_backend
from localmoe.backends.torch_backend import TorchBackend
from localmoe.errors import BackendUnavailableError


@register_backend("triton")
class TritonBackend(Backend):
    """Fused GPU path (Triton kernels over the paged, possibly quantized KV cache)."""

    description = "CUDA + Triton: fused sub-byte KV-cache decode attention (torch for the rest)"
    options = TorchBackend.options + ("cuda_graphs", "load_progress", "act_precision")

    def available(self) -> str | None:
        import importlib.util

        import torch

        # found, not imported: importing triton takes 0.2 s (more on a busy machine) that a
        # machine without a GPU would spend on every command for nothing
        if importlib.util.find_spec("triton") is None:
            return "triton not installed"
        if not torch.cuda.is_available():
            return "no CUDA device"
        return None

    def supports(self, model_format: str, kv_spec: Any = None) -> str | None:
        return torch_supports(model_format, kv_spec)

    def load(self, model, *, n_ctx: int | None = None, kv_spec: Any = None,
             device: str | None = None, **options: Any):
        """Build a :class:`localmoe.backends.triton.runner.TritonRunner` (options as for the
        torch backend).

        Raises:
            BackendUnavailableError: no CUDA device or Triton missing, or a non-CUDA device.
        """
        why = self.available()
        if why:
            raise BackendUnavailableError(f"backend 'triton' is not available: {why}")
        if device and not str(device).startswith("cuda"):
            raise BackendUnavailableError("the triton backend runs on CUDA devices only")
        from localmoe.backends.triton.runner import TritonRunner

        return TritonRunner(model, n_ctx=n_ctx, kv_spec=kv_spec, device=device, **options)
