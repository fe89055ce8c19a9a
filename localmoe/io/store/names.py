"""Model names: what a user calls a model, ``hf:`` references, split-shard and store file names."""

from __future__ import annotations

import os
import re
from pathlib import Path

from localmoe.errors import ModelNotFoundError
from localmoe.io.store.catalog import DEFAULT_MODEL

__all__ = ["display_name", "format_size", "parse_hf_ref"]


def display_name(model: str | os.PathLike | None) -> str:
    """Short name a user knows a model by, as Ollama shows it: the store or catalog name as
    given (``"smollm2"``), a ``.gguf`` file's name without the suffix, a safetensors folder's
    name, or :data:`DEFAULT_MODEL` for None; a shard of a split GGUF set is named as the set
    (``model-00002-of-00003.gguf`` -> ``model``, as :func:`store_name`)."""
    if model is None or str(model).strip() == "":
        return DEFAULT_MODEL
    s = str(model).strip()
    p = Path(s)
    if p.suffix.lower() == ".gguf":
        return store_name(p.name[:-5] + ".gguf")
    if p.is_dir():
        return p.name
    return s


def format_size(n: float) -> str:
    """Human size: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def nonempty(name: str | os.PathLike) -> str:
    """``name`` stripped; an empty name is an error (it never means the default model)."""
    s = str(name).strip()
    if not s:
        raise ModelNotFoundError(
            "empty model name; give a store name (see `localmoe models`), a file path or an "
            "hf:OWNER/REPO/FILE reference")
    return s


def parse_hf_ref(source: str) -> tuple[str, str | None, str]:
    """Split ``hf:OWNER/REPO[@REVISION]/PATH/IN/REPO.gguf`` into (repo, revision, filename),
    checked before anything is fetched: the repo id by the hub's rules, the file as a
    ``.gguf`` file inside the repo (a folder of it may lead: ``sub/f.gguf``; no ``.`` or
    ``..`` segment, no leading or doubled ``/``).

    Raises:
        ModelNotFoundError: malformed reference (one line, as every bad model reference).
    """
    usage = "use hf:OWNER/REPO/FILE.gguf, e.g. hf:Qwen/Qwen3-30B-A3B-GGUF/Qwen3-30B-A3B-Q4_K_M.gguf"
    ref = source[3:] if source.startswith("hf:") else source
    parts = ref.strip("/").split("/")
    if len(parts) < 3 or not all(parts[:2]) or not parts[-1]:
        raise ModelNotFoundError(f"bad Hugging Face reference {source!r}; {usage}")
    repo_name, _, rev = parts[1].partition("@")
    repo = f"{parts[0]}/{repo_name}"
    try:   # the hub's own rules for a repo id (characters, "--", "..", length)
        from huggingface_hub.utils import validate_repo_id
    except ImportError:  # pragma: no cover - a dependency
        validate_repo_id = None
    if validate_repo_id is not None:
        try:
            validate_repo_id(repo)
        except ValueError as e:   # HFValidationError
            raise ModelNotFoundError(
                f"bad Hugging Face reference {source!r}: {str(e).splitlines()[0].rstrip('.')}; "
                f"{usage}") from None
    filename = "/".join(parts[2:])
    if any(p in ("", ".", "..") for p in parts[2:]):
        raise ModelNotFoundError(
            f"bad Hugging Face reference {source!r}: the file {filename!r} is not a path inside "
            f"the repository (no '.' or '..' segment, no leading or doubled '/'); {usage}")
    if not filename.endswith(".gguf") or parts[-1] == ".gguf":
        raise ModelNotFoundError(
            f"bad Hugging Face reference {source!r}: {parts[-1]!r} is not a .gguf file (hf: "
            f"pulls GGUF files; for an HF safetensors model, download its folder and give its "
            f"path); {usage}")
    return repo, (rev or None), filename


_SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<n>\d{5})\.gguf$")


def shard_names(filename: str) -> list[str]:
    """All shard names of a split GGUF file name (or just the name itself)."""
    m = _SHARD_RE.match(filename)
    if not m:
        return [filename]
    n = int(m.group("n"))
    width = len(m.group("n"))
    return [f"{m.group('stem')}-{i:0{width}d}-of-{m.group('n')}.gguf" for i in range(1, n + 1)]


def tagged(filename: str, tag: str) -> str:
    """``filename`` with ``-<tag>`` after its stem (before a shard's ``-0000k-of-0000n``)."""
    m = _SHARD_RE.match(filename)
    if m:
        return f"{m.group('stem')}-{tag}-{m.group('no')}-of-{m.group('n')}.gguf"
    p = Path(filename)
    return f"{p.stem}-{tag}{p.suffix}"


def source_origin(source: str) -> str:
    """What makes two pulls the same model line: the same packages at any version, one hf:
    file at any revision, one local path."""
    if source.startswith("pip:"):
        return "pip:" + ",".join(re.split(r"[=<>!~ ]", r, maxsplit=1)[0].lower()
                                 for r in source[4:].split(","))
    if source.startswith("hf:"):
        return re.sub(r"@[^/]*", "", source)
    return source


def store_name(filename: str) -> str:
    """Store name of a pulled file: its name without ``.gguf`` (and without a shard suffix)."""
    m = _SHARD_RE.match(filename)
    stem = m.group("stem") if m else filename
    return stem[:-5] if stem.endswith(".gguf") else stem

