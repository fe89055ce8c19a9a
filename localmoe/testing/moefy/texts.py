"""English text for calibrating and evaluating moefied models, all from this machine, each with
a licence that can be named.

* ``python-reference`` (**calibration**): the Python Language Reference topics shipped with the
  standard library (``pydoc_data.topics``; Python Software Foundation License 2.0), ~465k
  characters of technical prose with some code.
* ``python-docstrings`` (**held-out**): docstrings of a fixed list of standard-library modules
  and their public classes/functions (:data:`DOCSTRING_MODULES`; PSF License 2.0). Same broad
  domain as the calibration text, different text.
* ``file:PATH`` (**held-out**): any text file, e.g. the repository's
  ``tests/data/gpl3_excerpt.txt`` (GNU GPL v3 text; verbatim copies are permitted by its own
  terms), a different domain (legal prose).

Calibration and evaluation never share text: :func:`corpus` refuses to return the calibration
corpus as held-out text.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

__all__ = ["CALIBRATION", "HELDOUT_DEFAULT", "DOCSTRING_MODULES", "corpus", "licence_of"]

CALIBRATION = "python-reference"
HELDOUT_DEFAULT = "python-docstrings"

#: standard-library modules whose docstrings make the ``python-docstrings`` corpus
DOCSTRING_MODULES = ("argparse", "collections", "functools", "json", "logging", "pathlib",
                     "textwrap", "unittest", "subprocess", "shutil", "itertools", "datetime")

_LICENCES = {
    "python-reference": "PSF-2.0 (Python Language Reference, pydoc_data.topics)",
    "python-docstrings": "PSF-2.0 (Python standard-library docstrings)",
}


def _python_reference() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k].strip() for k in sorted(topics.topics))


def _python_docstrings() -> str:
    parts = []
    for m in DOCSTRING_MODULES:
        mod = importlib.import_module(m)
        doc = inspect.getdoc(mod)
        if doc:
            parts.append(doc)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != m:
                continue
            d = inspect.getdoc(obj)
            if d:
                parts.append(d)
    return "\n\n".join(parts)


def corpus(name: str, *, heldout: bool = False) -> str:
    """The text of corpus ``name`` (``python-reference``, ``python-docstrings`` or ``file:PATH``).

    Args:
        heldout: the caller evaluates on it; the calibration corpus is then refused.
    Raises:
        ValueError: unknown corpus, or the calibration corpus requested as held-out text.
        OSError: ``file:PATH`` unreadable.
    """
    if heldout and name == CALIBRATION:
        raise ValueError(f"{name!r} is the calibration text; evaluate on held-out text "
                         f"(e.g. {HELDOUT_DEFAULT!r} or file:PATH)")
    if name == "python-reference":
        return _python_reference()
    if name == "python-docstrings":
        return _python_docstrings()
    if name.startswith("file:"):
        return Path(name[5:]).read_text(encoding="utf-8")
    raise ValueError(f"unknown corpus {name!r}; use python-reference, python-docstrings or file:PATH")


def licence_of(name: str) -> str:
    """A short licence note for corpus ``name`` (files: 'see the file')."""
    return _LICENCES.get(name, "see the file's own terms")
