"""Architecture families: one small file per family declaring only its delta from the shared
transformer block (localmoe.model.family.Family). Importing this package registers them all."""

from . import gemma3, llama, olmoe, qwen2, qwen2moe, qwen3, qwen3moe  # noqa: F401
