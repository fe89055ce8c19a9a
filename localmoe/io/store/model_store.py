"""The store itself: :class:`ModelStore` (manifest, lookup, pull, remove, resolve) and
:func:`resolve_model`. See :mod:`localmoe.io.store` for the layout."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from localmoe.errors import ModelLoadError, ModelNotFoundError, StoreError
from localmoe.io.console import note, stderr_is_terminal
from localmoe.io.store.catalog import CATALOG, DEFAULT_MODEL, CatalogEntry
from localmoe.io.store.names import format_size, nonempty, source_origin, tagged
from localmoe.io.store.pull import PARTIAL, PullMixin, ctrl_c_raises, hold_ctrl_c, sha256_file

__all__ = ["ModelStore", "StoredModel", "default_root", "resolve_model"]


def _home_env() -> str | None:
    """``$LOCALMOE_HOME``, None when unset or blank."""
    env = os.environ.get("LOCALMOE_HOME")
    return env if env and env.strip() else None


def default_root() -> Path:
    """Store root: ``$LOCALMOE_HOME`` if set (blank counts as unset), else platformdirs' user
    data dir."""
    env = _home_env()
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("localmoe", appauthor=False))


@dataclass
class StoredModel:
    """One manifest entry.

    Attributes:
        name: store name.
        path: the model's path (first shard for split GGUF, the folder for HF directories).
        files: every file belonging to it (absolute paths).
        size: bytes on disk now (the files' real sizes, not what the pull recorded).
        recorded_size: bytes the pull stored (a different ``size`` means the files changed:
            truncated or damaged).
        sha256: digest of the (first) file, "" when not computed (linked directories).
        source: where it came from (``pip:...``, ``hf:...``, ``file:...``).
        linked: True when the store only references a file outside it.
        missing: True when a file of it is gone (deleted behind the store's back): it cannot
            load; pull it again or remove it.
        shared_with: after :meth:`ModelStore.remove`, the other entries that use its files
            (which were kept).
        freed: after :meth:`ModelStore.remove`, the bytes of the files it deleted.
        kept_outside: after :meth:`ModelStore.remove`, its files outside the store folder
            (an entry edited by hand), which were left in place.
    """

    name: str
    path: Path
    files: list[Path] = field(default_factory=list)
    size: int = 0
    sha256: str = ""
    source: str = ""
    recorded_size: int = 0
    linked: bool = False
    pulled_at: float = 0.0
    missing: bool = False
    shared_with: list[str] = field(default_factory=list)
    freed: int = 0
    kept_outside: list[Path] = field(default_factory=list)

    @property
    def source_path(self) -> Path | None:
        """The local path it was pulled from (a ``file:`` source), else None."""
        return Path(self.source[5:]) if self.source.startswith("file:") else None

    @property
    def changed(self) -> bool:
        """A linked file (the user's, registered in place) whose size is not the one it was
        linked with: edited, replaced or cut short since. Not :attr:`damaged` (the user may have
        changed it on purpose, and loading checks the file anyway); ``localmoe pull NAME``
        links it again, checking it and recording its new size and sha256."""
        return (self.linked and not self.missing and bool(self.recorded_size)
                and self.size != self.recorded_size)

    @property
    def damaged(self) -> bool:
        """The store's own files are there but not the size the pull recorded (truncated or
        overwritten behind the store's back): ``localmoe pull NAME`` downloads them again."""
        return (not self.linked and not self.missing and bool(self.recorded_size)
                and self.size != self.recorded_size)


def _check_manifest(data) -> None:
    """Raise ValueError where ``data`` (a parsed manifest) is not ``{name: entry}`` with
    entries as :meth:`ModelStore._entry` reads them: ``files`` a list of path strings,
    ``size``/``pulled_at`` numbers, ``sha256``/``source`` strings."""
    if not isinstance(data, dict):
        raise ValueError(f"a JSON object of models was expected, found {type(data).__name__}")
    for name, e in data.items():
        if not isinstance(e, dict):
            raise ValueError(f"the entry of {name!r} is {type(e).__name__}, not an object")
        files = e.get("files", [])
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise ValueError(f"the files of {name!r} are not a list of paths")
        for key in ("size", "pulled_at"):
            v = e.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"the {key} of {name!r} is not a number")
        for key in ("sha256", "source"):
            if not isinstance(e.get(key, ""), str):
                raise ValueError(f"the {key} of {name!r} is not a string")


class ModelStore(PullMixin):
    """The local model store (see :mod:`localmoe.io.store` for the layout).

    Args:
        root: store root; default :func:`default_root`.
        index_url: package index for catalog pulls; default ``$LOCALMOE_INDEX_URL`` or pip's
            configuration.
        progress: True: progress bars on stderr; False: silent; None (default): bars when
            stderr is a terminal, else one plain line on stderr when :meth:`resolve` starts
            pulling a model and one when it is done (logs, pipes, CI).
    """

    def __init__(self, root: str | os.PathLike | None = None, *, index_url: str | None = None,
                 progress: bool | None = None, catalog: dict[str, CatalogEntry] | None = None):
        self.root = Path(root) if root is not None else default_root()
        self.models_dir = self.root / "models"
        self.index_url = index_url if index_url is not None else os.environ.get("LOCALMOE_INDEX_URL")
        self.progress = stderr_is_terminal() if progress is None else bool(progress)
        self.plain_progress = progress is None and not self.progress  # no terminal: plain lines
        self.catalog = CATALOG if catalog is None else catalog

    # ---- manifest -------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.models_dir / "manifest.json"

    def _read_manifest(self) -> dict[str, dict]:
        try:
            with open(self.manifest_path, encoding="utf-8") as f:
                data = json.load(f)
            _check_manifest(data)
            return data
        except FileNotFoundError:
            return {}
        except NotADirectoryError:
            raise self._not_a_folder_error() from None
        except (OSError, ValueError) as e:
            raise StoreError(f"model store manifest {self.manifest_path} is unreadable ({e}); "
                             f"delete it, then `localmoe pull FILE` for each model file in "
                             f"{self.models_dir} lists it again without copying or downloading "
                             f"(or pull the models by name again)") from e

    def _not_a_folder_error(self) -> StoreError:
        """The error for a store root (or a folder on its way) that is a file, naming it."""
        blocker = next((d for d in (self.models_dir, *self.models_dir.parents)
                        if d.exists() and not d.is_dir()), None)
        detail = f" ({blocker} is a file)" if blocker not in (None, self.root) else ""
        if blocker is not None and self.root in blocker.parents:  # root/models is a file
            return StoreError(f"the model store folder {self.models_dir} is not a directory"
                              f"{detail}; move that file away")
        what = (f"LOCALMOE_HOME {self.root}" if _home_env()
                else f"the model store folder {self.root}")
        return StoreError(f"{what} is not a directory{detail}; set LOCALMOE_HOME to a folder "
                          f"(it is created when missing)")

    def _writable_models_dir(self) -> None:
        """Create the store's models folder if missing and check it can be written to, before
        a pull starts (and before :meth:`resolve` says it is pulling).

        Raises:
            StoreError: it cannot be created (``LOCALMOE_HOME=/proc/nope``), a file is in the
                way, or it is not writable; naming the folder and LOCALMOE_HOME.
        """
        try:
            self.models_dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise self._not_a_folder_error() from None
        except OSError as e:
            raise StoreError(f"cannot create the model store folder {self.models_dir}: "
                             f"{e.strerror or e}; set LOCALMOE_HOME to a writable folder") from None
        if not os.access(self.models_dir, os.W_OK | os.X_OK):  # read-only mount or mode
            raise StoreError(f"the model store folder {self.models_dir} is not writable; set "
                             f"LOCALMOE_HOME to a writable folder")

    def _write_manifest(self, data: dict[str, dict]) -> None:
        self.models_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.manifest_path.with_name(f"manifest.json{PARTIAL}{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.manifest_path)

    def _entry(self, name: str, e: dict) -> StoredModel:
        files = [Path(p) if os.path.isabs(p) else self.models_dir / p for p in e.get("files", [])]
        missing = not files or not all(p.exists() for p in files)
        recorded = int(e.get("size", 0))
        return StoredModel(name=name, path=files[0] if files else Path(), files=files,
                           size=recorded if missing else sum(_path_size(f) for f in files),
                           sha256=e.get("sha256", ""), recorded_size=recorded,
                           source=e.get("source", ""), linked=bool(e.get("linked", False)),
                           pulled_at=float(e.get("pulled_at", 0.0)), missing=missing)

    def list(self, *, include_missing: bool = False) -> list[StoredModel]:
        """Every stored model whose files still exist, sorted by name (with
        ``include_missing``, also those whose files are gone, ``missing=True``)."""
        out = []
        for name, e in sorted(self._read_manifest().items()):
            m = self._entry(name, e)
            if include_missing or not m.missing:
                out.append(m)
        return out

    def get(self, name: str, *, include_missing: bool = False) -> StoredModel | None:
        """The stored model called ``name`` (store name, catalog name, file name or the
        ``hf:`` reference it was pulled from), or None; one whose files are gone only with
        ``include_missing``."""
        name = name.strip()
        items = self.list(include_missing=include_missing)
        for m in items:  # a store name wins over another entry's file name
            if name == m.name:
                return m
        for m in items:  # a file named like a catalog model that is not it does not answer
            if name in (m.path.name, m.path.stem) and not self._not_catalogs(name, m.sha256):
                return m
        for m in items:  # an hf: reference already pulled
            if name.startswith("hf:") and m.source == name:
                return m
        return None

    def find(self, name: str) -> Path | None:
        """Path of the stored model ``name`` (e.g. ``"smollm2"``), or None when not pulled."""
        m = self.get(name)
        return m.path if m else None

    # ---- pulling --------------------------------------------------------------------------
    def pull(self, source: str, *, force: bool = False, link: bool = False) -> StoredModel:
        """Fetch ``source`` into the store and return its entry.

        Args:
            source: a catalog name, ``hf:OWNER/REPO[@REV]/FILE``, or a local path.
            force: fetch again even when already stored.
            link: for a local file, register it in place instead of copying it.

        Raises:
            StoreError: download failed, checksum mismatch, disk error.
            ModelNotFoundError: unknown name and no such path.
        """
        source = nonempty(source)
        m = self.get(source, include_missing=True)
        if m is not None and self._squatter(m, source):
            # another file stored under the catalog's name (an earlier version let a local
            # ./smollm2.gguf take it): it moves to a tagged name, the catalog model comes
            new = self._set_aside(source)
            note(f"{source}: the stored entry is {m.source_path}, not the catalog model; it "
                 f"is now {new!r}, pulling {source}")
            m = None
        if m is not None and (source in self.catalog or source.startswith("hf:")
                              or m.name == source):
            # a stored model named: whole, it is the answer; damaged, missing (or forced) it
            # is fetched again from where it came from
            bad = ("its file is missing" if m.missing
                   else self._damage(m, self.catalog.get(source)))
            if bad is None and not force:
                return m
            origin = self._origin(m, source)
            if origin is None:
                raise ModelNotFoundError(f"model {m.name!r}: {bad or 'asked to fetch it again'}; "
                                         f"{self.repair_hint(m)}")
            if bad is not None:
                note(f"{m.name}: {bad}; pulling it again from {origin}")
            source, link = origin, link or m.linked
        self._writable_models_dir()
        p = Path(source).expanduser()
        if source in self.catalog or source.startswith("hf:") or p.exists():
            # what the pull imports, imported before Ctrl-C raises (never inside an import)
            with contextlib.suppress(ImportError):
                if source.startswith("hf:"):
                    import huggingface_hub  # noqa: F401
                elif source not in self.catalog:
                    import localmoe.io.loader as loader  # noqa: F401
            try:
                self._clean_partials()
                with ctrl_c_raises():  # so the finally blocks remove this pull's temporaries
                    if source in self.catalog:
                        return self._pull_catalog(self.catalog[source])
                    if source.startswith("hf:"):
                        return self._pull_hf(source)
                    return self._pull_path(p, link=link)
            except OSError as e:   # e.g. a store on a read-only or full file system
                raise self._os_error(f"cannot pull {source}", e) from None
        _raise_if_missing_path(source)
        raise ModelNotFoundError(
            f"{source!r} is not a known model name, an hf:OWNER/REPO/FILE reference or an "
            f"existing path; known names: {', '.join(self.catalog)}")

    def _not_catalogs(self, name: str, sha: str) -> bool:
        """Whether ``name`` is a catalog name and content of sha256 ``sha`` is not that
        catalog model's (so it may not take or answer for the name)."""
        c = self.catalog.get(name)
        return c is not None and c.sha256 != sha

    def _squatter(self, m: StoredModel, name: str) -> bool:
        """Whether ``m``, asked for by the catalog name ``name``, is another file stored
        under that name (a local file pulled by an earlier version), not the catalog model."""
        return m.name == name and m.source_path is not None and self._not_catalogs(name, m.sha256)

    def _set_aside(self, name: str) -> str:
        """Move the entry ``name`` to a name tagged with its sha256 (:meth:`_free_name`,
        never ``name``) and return that name; where the same file is already stored under it,
        the entry is dropped instead (its copies that nothing uses deleted, as ``rm`` does)."""
        with hold_ctrl_c():
            data = self._read_manifest()
            e = data.pop(name)
            new = self._free_name(data, name, e.get("source", ""), e.get("sha256", ""),
                                  reserved=True)
            held = data.get(new)
            keep = held is None or not all(f.exists() for f in self._files(held))
            if keep:
                data[new] = e
            self._write_manifest(data)
            if not keep:
                self._drop_files(self._entry(name, e), data)
            return new

    def _known_name(self, s: str) -> bool:
        """Whether ``s`` is a bare name (:func:`_bare`) of the catalog or the store (an
        unreadable manifest counts as not knowing it: the path is used)."""
        if not _bare(s):
            return False
        if s in self.catalog:
            return True
        try:
            return self.get(s, include_missing=True) is not None
        except StoreError:
            return False

    def repair_hint(self, m: StoredModel) -> str:
        """What fixes the missing or damaged stored model ``m``: ``localmoe pull NAME`` while
        what it was pulled from is there (:meth:`pull` fetches it again), else the source
        that is gone; ``localmoe rm NAME`` either way."""
        if self._origin(m, m.name) is not None:
            return f"`localmoe pull {m.name}` fetches it again, or `localmoe rm {m.name}`"
        if m.source_path is not None:
            return (f"it was pulled from {m.source_path}, which is not there any more: pull "
                    f"the file from where it is now, or `localmoe rm {m.name}`")
        return f"`localmoe rm {m.name}`, then pull it again"

    def _origin(self, m: StoredModel, asked: str) -> str | None:
        """What :meth:`pull` fetches to store ``m`` again (asked for as ``asked``): the catalog
        name or ``hf:`` reference asked for or recorded, or the local path it was pulled from
        while that path exists; None when there is none."""
        if asked in self.catalog or asked.startswith("hf:"):
            return asked
        if m.source.startswith("hf:"):
            return m.source
        if m.source.startswith("pip:") and m.name in self.catalog:
            return m.name
        if m.source_path is not None and m.source_path.exists():
            return str(m.source_path)
        return None

    #: stored files up to this size are checked against the catalog's sha256 on a pull
    HASH_CHECK_MAX = 1 << 30

    def _damage(self, m: StoredModel, entry: CatalogEntry | None = None) -> str | None:
        """Why the stored files of ``m`` are not what was pulled (a size that differs from the
        catalog's or the recorded one; for a catalog model up to :data:`HASH_CHECK_MAX`
        bytes, a sha256 that differs; for a linked file, its size or, up to that size, its
        sha256 changed since it was linked), or None when they look whole."""
        if m.missing:
            return None
        if m.linked:
            if m.changed:
                return (f"the linked file is {m.size:,} bytes, not the {m.recorded_size:,} it "
                        f"was linked with (changed since)")
            if (m.sha256 and len(m.files) == 1 and m.path.is_file()
                    and m.size <= self.HASH_CHECK_MAX and sha256_file(m.path) != m.sha256):
                return "the linked file's sha256 differs from the one it was linked with (changed since)"
            return None
        want = entry.size if entry is not None and entry.size else m.recorded_size
        if want and m.size != want:
            return (f"the stored file is {m.size:,} bytes, not {want:,} (truncated or "
                    f"damaged)")
        if (entry is not None and entry.sha256 and len(m.files) == 1
                and m.size <= self.HASH_CHECK_MAX and sha256_file(m.path) != entry.sha256):
            return "the stored file's sha256 differs from the catalog's (damaged)"
        return None

    def _files(self, e: dict) -> list[Path]:
        return [Path(p) if os.path.isabs(p) else self.models_dir / p for p in e.get("files", [])]

    def _commit(self, name: str, source: str, sha: str, *,
                temps: list[tuple[Path, str, str]] = (), linked: list[Path] | None = None,
                adopt: list[Path] | None = None) -> StoredModel:
        """Put a pulled model in place and record it in the manifest.

        ``temps`` are finished temporaries ``(path, file name, sha256)`` inside ``models/`` (one
        per shard), renamed to their file names, or to names tagged with the sha256 when those
        are taken by a file of different content (:meth:`_place`); ``linked`` are files
        registered in place instead (the user's); ``adopt`` are files already in ``models/``
        that become the store's own. ``name`` is replaced when it holds the same model (same
        origin or content) or a model whose files are gone, else the entry gets a name tagged
        with the sha256: a pull never replaces what another entry stores. Ctrl-C waits until
        the files and the manifest agree. The replaced entry's stored files that no entry
        uses any more are deleted (a linked entry's files are the user's: never)."""
        with hold_ctrl_c():
            data = self._read_manifest()
            name = self._catalog_alias(data, name, source, sha)
            # a catalog name belongs to the catalog's model: another file of that name (a
            # local ./smollm2.gguf) gets a tagged name, never the default model's
            name = self._free_name(data, name, source, sha,
                                   reserved=self._not_catalogs(name, sha))
            others = {os.path.realpath(f) for k, e in data.items() if k != name
                      for f in self._files(e)}
            old = data.get(name)
            own = set() if old is None or old.get("linked") else \
                {os.path.realpath(f) for f in self._files(old)} - others
            if linked is None:
                files = list(adopt) if adopt is not None else self._place(temps, own)
                rel = [os.path.relpath(f, self.models_dir) for f in files]
            else:
                files, rel = linked, [str(f) for f in linked]
            data[name] = {"files": rel, "sha256": sha, "source": source,
                          "size": sum(_path_size(f) for f in files),
                          "linked": linked is not None, "pulled_at": time.time()}
            self._write_manifest(data)
            if old is not None:  # the replaced entry's copies nothing uses any more
                self._drop_files(self._entry(name, old), data)
            return self._entry(name, data[name])

    def _catalog_alias(self, data: dict[str, dict], name: str, source: str, sha: str) -> str:
        """The catalog's name for a local file whose bytes are a catalog model's (same sha256),
        so that ``localmoe pull ./SmolLM2-135M-Instruct.Q4_1.gguf`` (a manual download, or the
        store's own file after a damaged manifest was deleted) is ``smollm2`` as a pull by name
        would have made it; ``name`` when no catalog entry matches or that name already holds
        a model whose files are present (the same one included: a second entry, as before)."""
        if not sha or not source.startswith("file:"):
            return name
        for c in self.catalog.values():
            if c.sha256 == sha:
                e = data.get(c.name)
                if e is None or not all(f.exists() for f in self._files(e)):
                    return c.name
        return name

    def _free_name(self, data: dict[str, dict], name: str, source: str, sha: str, *,
                   reserved: bool = False) -> str:
        """The entry a pull of ``source`` named ``name`` goes to: the one it updates (``name``,
        or a ``name-...`` entry, pulled from the same origin before), else ``name`` or
        ``name-<sha256 prefix>``, whichever is free, holds the same content or lost its files
        (``reserved``: never ``name`` itself)."""
        origin = source_origin(source)
        first = [] if reserved else [name]
        for k in first + sorted(k for k in data if k.startswith(name + "-")):
            if k in data and source_origin(data[k].get("source", "")) == origin:
                return k
        tag = sha or hashlib.sha256(source.encode()).hexdigest()
        for cand in first + [f"{name}-{tag[:n]}" for n in (8, 12, 16, 64)]:
            e = data.get(cand)
            if (e is None or (sha and e.get("sha256") == sha)
                    or not all(f.exists() for f in self._files(e))):
                return cand
        i = 2
        while f"{name}-{tag[:8]}-{i}" in data:
            i += 1
        return f"{name}-{tag[:8]}-{i}"

    def _place(self, temps: list[tuple[Path, str, str]], own: set[str]) -> list[Path]:
        """Rename finished temporaries to their file names in ``models/``; return the paths.

        A name is free when no file has it, when only the entry being replaced uses it
        (``own``, real paths), or when the file there has the same content (then it is shared
        and the temporary dropped). Otherwise every file of the set gets the first file's sha256
        prefix in its stem (``model-<sha>.gguf``, ``model-<sha>-00001-of-00002.gguf``): an
        existing file of different content is never replaced."""
        if not temps:
            return []
        tag = temps[0][2]
        tags = ["", tag[:12], tag[:16], tag] + [f"{tag[:12]}-{i}" for i in range(2, 1000)]

        def same(path: Path, sha: str, size: int) -> bool:
            return path.is_file() and path.stat().st_size == size and sha256_file(path) == sha

        for t in tags:
            plan = []
            for tmp, fname, sha in temps:
                final = self.models_dir / (tagged(fname, t) if t else fname)
                if not os.path.lexists(final) or os.path.realpath(final) in own:
                    plan.append((tmp, final, False))
                elif same(final, sha, tmp.stat().st_size):
                    plan.append((tmp, final, True))
                else:
                    break
            else:
                for tmp, final, shared in plan:
                    if shared:
                        tmp.unlink()
                    else:
                        os.replace(tmp, final)
                return [final for _, final, _ in plan]
        raise StoreError(f"no free file name for {temps[0][1]} in {self.models_dir}")

    def remove(self, name: str) -> StoredModel:
        """Delete a stored model: its entry, and its files that no other entry uses (linked
        files, and any file outside the store folder, are left alone). An entry whose files are
        gone is removed too. The returned entry's ``shared_with`` names the entries whose files
        were kept, ``freed`` the bytes deleted and ``kept_outside`` the files outside the store
        that an unlinked entry (edited by hand) named and that were left in place.

        Raises:
            ModelNotFoundError: no stored model has that name.
        """
        name = nonempty(name)
        data = self._read_manifest()
        m = self.get(name, include_missing=True)
        if m is None:
            raise ModelNotFoundError(f"no stored model named {name!r}; see `localmoe models`")
        with hold_ctrl_c():
            del data[m.name]
            try:
                self._write_manifest(data)  # first: an interrupted rm leaves no entry without files
                m.shared_with = self._drop_files(m, data)
            except OSError as e:
                raise self._os_error(f"cannot remove {m.name}", e) from None
        return m

    def _os_error(self, what: str, e: OSError) -> StoreError:
        """A :class:`StoreError` for an OSError while writing the store: what failed, the
        system's reason and the file; for a read-only, unwritable or full store, where to
        put it instead."""
        where = f" ({e.filename})" if e.filename else ""
        hint = ("; set LOCALMOE_HOME to a writable folder with room for the models"
                if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC) else "")
        return StoreError(f"{what}: {e.strerror or e}{where}{hint}")

    def _drop_files(self, m: StoredModel, data: dict[str, dict]) -> list[str]:
        """Delete the stored files of ``m`` (no longer in ``data``) that no entry of ``data``
        uses; return the names of the entries that use the others. Sets ``m.freed`` and
        ``m.kept_outside`` (see :meth:`remove`)."""
        users: dict[str, list[str]] = {}
        for k, e in data.items():
            for f in self._files(e):
                users.setdefault(os.path.realpath(f), []).append(k)
        shared: list[str] = []
        for f in m.files:
            who = users.get(os.path.realpath(f))
            if who:
                shared += [k for k in who if k not in shared]
            elif m.linked:
                continue  # the user's files, registered in place
            elif Path(os.path.realpath(f)).parent == self.models_dir.resolve():
                size = _path_size(f)
                f.unlink(missing_ok=True)  # only the store's own copies, never a user's file
                m.freed += size
            elif f.exists():
                m.kept_outside.append(f)
        return shared

    def resolve(self, name_or_path: str | os.PathLike | None = None, *, pull: bool = True) -> Path:
        """Turn a model argument into a path.

        ``None`` means the default model (:data:`DEFAULT_MODEL`, from the store or the
        catalog, whatever the current folder holds), an empty name is an error; an existing
        path is returned as is, except that a bare name (no folder part, no ``.gguf``, not
        starting with ``.`` or ``~``) the store or the catalog knows means that model even
        when a file or folder of that name is in the current folder (``./NAME`` is the
        path); a stored name gives its file; a catalog name or ``hf:`` reference not yet
        stored is pulled when ``pull`` is true (said on stderr: a progress bar on a terminal,
        else a plain line when the pull starts; then one line when it is done; see
        ``progress``).

        Raises:
            ModelNotFoundError: not a path, not stored, not pullable, empty.
            ModelLoadError: a stored model whose files are not the size it was pulled with.
            StoreError: the pull failed.
        """
        default = name_or_path is None
        if default:
            name_or_path = DEFAULT_MODEL
        s = nonempty(name_or_path)
        p = Path(s).expanduser()
        if not default and p.exists() and not self._known_name(s):
            return p
        m = self.get(s)
        if m is not None and self._squatter(m, s):
            if not pull:
                raise ModelNotFoundError(
                    f"model {s!r} in the store is {m.source_path}, not the catalog model; run "
                    f"`localmoe pull {s}` (the other file keeps a tagged name)")
            m = None   # the pull below moves it aside and fetches the catalog model
        if m is not None:
            if m.damaged:
                raise ModelLoadError(
                    f"model {m.name!r} in the store is {m.size:,} bytes on disk, not the "
                    f"{m.recorded_size:,} it was pulled with (truncated or damaged); "
                    f"{self.repair_hint(m)}")
            return m.path
        if s in self.catalog or s.startswith("hf:"):
            if not pull:
                raise ModelNotFoundError(f"model {s!r} is not pulled yet; run `localmoe pull {s}`")
            if s.startswith("hf:"):  # a malformed reference fails before "pulling ..."
                from localmoe.io.store.names import parse_hf_ref
                from localmoe.io.store.pull import hf_endpoint

                parse_hf_ref(s)
                hf_endpoint()  # so does a malformed $HF_ENDPOINT
            self._writable_models_dir()  # so is a store that cannot be made or written
            t0 = time.monotonic()
            if self.plain_progress:  # no terminal for a bar: one line now, one when done
                entry = self.catalog.get(s)
                size = f" ({format_size(entry.size)})" if entry is not None and entry.size else ""
                note(f"pulling {s}{size} into {self.models_dir} (once) ...")
            m = self.pull(s)  # on a terminal: one progress bar, gone when done
            if self.plain_progress or self.progress:
                note(f"pulled {s} ({format_size(m.size)}) in {time.monotonic() - t0:.0f} s: "
                     f"{m.path}")
            return m.path
        gone = self.get(s, include_missing=True)
        if gone is not None:
            if not gone.files:
                raise ModelNotFoundError(
                    f"model {gone.name!r} is in the store but its entry lists no files "
                    f"(a damaged manifest); {self.repair_hint(gone)}")
            lost = next((f for f in gone.files if not f.exists()), gone.path)
            raise ModelNotFoundError(
                f"model {gone.name!r} is in the store but its file {lost} is missing; "
                f"{self.repair_hint(gone)}")
        _raise_if_missing_path(s)
        raise ModelNotFoundError(
            f"no model named {s!r}: not a file, not in the store (`localmoe models`), and not one "
            f"of the pullable names {', '.join(self.catalog)}; give a path or `localmoe pull` it")


def _bare(s: str) -> bool:
    """A model argument that reads as a name, not a path: no folder part, no ``.gguf``
    ending, not starting with ``.`` or ``~``."""
    return not (os.sep in s or "/" in s or s.startswith((".", "~")) or s.endswith(".gguf"))


def _raise_if_missing_path(s: str) -> None:
    """A name that is not there and reads as a path (a ``.gguf`` name or a folder separator)
    is a missing file, not an unknown model name: raise ModelNotFoundError saying so."""
    if s.endswith(".gguf") or os.sep in s:
        raise ModelNotFoundError(f"model file {s} does not exist")


def resolve_model(name_or_path: str | os.PathLike | None = None) -> Path:
    """Path of a model given by path, store name, catalog name, ``hf:`` reference or None
    (the default model, pulled on first use). See :meth:`ModelStore.resolve`."""
    return ModelStore().resolve(name_or_path)


def _path_size(p: Path) -> int:
    """Bytes of a file, or of every file under a folder (0 when gone)."""
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return p.stat().st_size if p.exists() else 0

