"""Import Hugging Face's ``kernels`` package before this checkout's ``kernels/`` folder can
shadow it.

This repository keeps the sources of ``localmoe.kernels`` in a top-level ``kernels/`` folder
(pyproject.toml maps it into the package). Run from the repository root (``python -m
localmoe.testing.synthetic --hf``, pytest, ``python -c``), the root stands first on
``sys.path`` and ``import kernels`` finds that folder, while transformers (>= 5.25) imports the
installed ``kernels`` distribution (Hugging Face's hub kernels): ``cannot import name
'CUDAProperties' from 'kernels' (.../kernels/__init__.py)``. :func:`installed_kernels_first`
imports the installed one with such entries left out of ``sys.path``, so ``sys.modules`` holds
it for every later ``import kernels``. Standard library only (cheap to import).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

__all__ = ["installed_kernels_first", "shadowing_entries"]


def _checkout_kernels_dirs() -> set[Path]:
    """The folders holding ``localmoe.kernels``' sources: where the package maps it (an
    editable install), and ``kernels/`` beside the ``localmoe`` package imported (a checkout
    run from its root, installed or not)."""
    import localmoe

    dirs = {Path(localmoe.__file__).resolve().parent.parent / "kernels"}
    try:
        spec = importlib.util.find_spec("localmoe.kernels")   # not executed: no triton import
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        dirs.add(Path(loc).resolve())
    return dirs


def shadowing_entries(path: list[str] | None = None) -> list[str]:
    """The entries of ``path`` (default ``sys.path``) whose ``kernels`` folder is this
    checkout's ``localmoe.kernels`` sources, not an installed ``kernels`` package (``""`` is
    the current folder)."""
    ours = _checkout_kernels_dirs()
    out = []
    for entry in sys.path if path is None else path:
        if not isinstance(entry, str):
            continue
        try:
            candidate = (Path(entry or os.getcwd()) / "kernels").resolve()
        except (OSError, RuntimeError):
            continue
        if candidate in ours and candidate.is_dir():
            out.append(entry)
    return out


def installed_kernels_first() -> None:
    """Import the installed ``kernels`` distribution, if there is one, with the
    :func:`shadowing_entries` left out of ``sys.path`` for that import (``sys.path`` is the
    same afterwards). A ``kernels`` module already imported from this checkout's folder is
    dropped from ``sys.modules`` first; one imported from elsewhere is left alone. Call it
    before importing transformers. A broken installed ``kernels`` is left for transformers
    to report."""
    mod = sys.modules.get("kernels")
    shadow = shadowing_entries()
    if mod is not None:
        where = getattr(mod, "__file__", None)
        if where is None or Path(where).resolve().parent not in _checkout_kernels_dirs():
            return   # the installed one (or a stand-in someone chose): nothing to do
        for name in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
            del sys.modules[name]
    if not shadow:
        return
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if p not in shadow]
    try:
        if importlib.util.find_spec("kernels") is not None:
            importlib.import_module("kernels")
    except Exception:  # noqa: BLE001 -- a broken optional package: transformers says so itself
        pass
    finally:
        sys.path[:] = saved
