"""Architecture families: one small file per family declaring only its delta from the shared
transformer block (:class:`localmoe.models.family.Family`). Importing this package registers
them all; :func:`get_family` looks one up."""

from . import family  # noqa: F401  (first: the built-in families register with it)
from . import gemma3, llama, olmoe, qwen2, qwen2moe, qwen3, qwen3moe  # noqa: F401
from .family import FAMILIES, Family, get_family, register_family  # noqa: F401
