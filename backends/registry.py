"""Backend registry.

A backend is a small factory class registered with :func:`register_backend`; its heavy imports
happen inside ``available()`` and ``load()`` so that listing backends is cheap. Third-party
backends register through the ``localmoe.backends`` entry-point group.

Auto selection order (DESIGN.md): ``triton`` (CUDA + Triton) -> ``llamacpp`` (GGUF on CPU,
llama-cpp-python installed) -> ``torch`` (reference, runs anywhere).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

# the thread-count checks live in the cpu layer; re-exported for the engine, CLI and server
from localmoe.cpu.threads import MAX_THREADS, THREADS_ENV, check_threads, env_threads  # noqa: F401
from localmoe.errors import BackendUnavailableError

_REGISTRY: dict[str, type] = {}
_BUILTIN_MODULES = ("localmoe.backends.triton", "localmoe.backends.llamacpp_backend",
                    "localmoe.backends.torch_backend")
AUTO_ORDER = ("triton", "llamacpp", "torch")
_loaded = False


class Backend:
    """Base class of backend factories.

    Subclasses set ``name`` and ``description`` and implement :meth:`available` and
    :meth:`load`; :meth:`supports` refuses model formats or KV cache specs they cannot run.
    """

    name: str = ""
    description: str = ""
    #: keyword options :meth:`load` takes beyond ``n_ctx``, ``kv_spec`` and ``device``
    options: tuple[str, ...] = ()

    def accepts(self, option: str) -> bool:
        """Whether :meth:`load` takes the keyword option ``option``."""
        return option in self.options

    def available(self) -> str | None:
        """None when the backend can run here, else a short human reason."""
        return None

    def supports(self, model_format: str, kv_spec: Any = None) -> str | None:
        """None when the backend can run this model format ('gguf'|'safetensors') and KV spec,
        else a reason (shown to the user before weights load)."""
        return None

    def check_device(self, device: str | None) -> str | None:
        """None when ``device`` (None, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``, as
        :func:`localmoe.engine.options.check_device` accepts) exists here for this backend, else a reason
        (shown to the user before weights load). Default: CUDA devices as torch sees them
        (:func:`cuda_device_problem`)."""
        return cuda_device_problem(device)

    def load(self, model: Any, *, n_ctx: int | None = None, kv_spec: Any = None,
             device: str | None = None, **options: Any):
        """Build and return a Runner for ``model`` (a ModelFile). Raises LocalMoEError subclasses."""
        raise BackendUnavailableError(f"backend {self.name!r} cannot load models")


def check_backend_options(options: Any, backend: Backend | None = None) -> None:
    """Refuse keyword options that no registered backend takes (``backend`` None; before any
    I/O) or that ``backend`` does not take (before its weights load).

    Raises:
        InvalidRequestError: naming the option, the backends that take it (if any) and the
            closest known option.
    """
    import difflib

    from localmoe.errors import InvalidRequestError

    names = list(options or ())
    if not names:
        return
    backends = [get_backend(n) for n in backend_names()]
    known = sorted({o for b in backends for o in b.options})
    for opt in names:
        if backend is not None:
            if backend.accepts(opt):
                continue
            takers = [b.name for b in backends if b.accepts(opt)]
            where = (f"an option of the {', '.join(takers)} backend{'s' if len(takers) > 1 else ''}"
                     f", not of {backend.name!r} (which runs this model)") if takers else \
                f"not an option of the {backend.name!r} backend"
            raise InvalidRequestError(f"{opt!r} is {where}; {backend.name!r} takes: "
                                      f"{', '.join(backend.options) or 'no options'}",
                                      param=opt)
        if any(b.accepts(opt) for b in backends):
            continue
        close = difflib.get_close_matches(opt, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InvalidRequestError(f"unknown option {opt!r}{hint}; the backends take: "
                                  f"{', '.join(known)}", param=opt)


def cuda_device_problem(device: str | None) -> str | None:
    """Why ``device`` (``"cuda"``, ``"cuda:N"``; anything else passes) is missing here: no
    CUDA device visible to torch, or no device N (``CUDA_VISIBLE_DEVICES`` applies); None when
    it exists. Imports torch only for a CUDA device."""
    d = str(device or "").strip().lower()
    if not d.startswith("cuda"):
        return None
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return f"device {device!r} requested but no CUDA device is visible here; use cpu"
    idx = int(d[5:]) if d[5:].isdigit() else 0
    if idx >= n:
        have = "cuda:0" if n == 1 else f"cuda:0 to cuda:{n - 1}"
        return (f"device {device!r} does not exist: {n} CUDA device{'s' if n > 1 else ''} "
                f"visible here ({have})")
    return None


def register_backend(name: str) -> Callable[[type], type]:
    """Class decorator: register a :class:`Backend` subclass under ``name``."""

    def deco(cls: type) -> type:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _BUILTIN_MODULES:
        try:
            importlib.import_module(mod)
        except ImportError:
            pass
    try:
        from importlib.metadata import entry_points

        for ep in entry_points(group="localmoe.backends"):
            try:
                ep.load()
            except Exception:  # a broken plugin must not break the app
                pass
    except Exception:
        pass


def backend_names() -> list[str]:
    """Names of registered backends, auto order first."""
    _load_all()
    known = [n for n in AUTO_ORDER if n in _REGISTRY]
    return known + sorted(n for n in _REGISTRY if n not in known)


def get_backend(name: str) -> Backend:
    """Instantiate the backend registered as ``name`` (case and surrounding spaces ignored:
    ``"Torch"`` is ``torch``).

    Raises:
        BackendUnavailableError: no backend of that name is registered.
    """
    _load_all()
    if isinstance(name, str) and name not in _REGISTRY:
        name = name.strip().lower()
    if name not in _REGISTRY:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; choose one of: auto, {', '.join(backend_names())}")
    return _REGISTRY[name]()


def list_backends() -> list[tuple[str, str | None, str]]:
    """(name, reason-or-None, description) for every registered backend."""
    out = []
    for n in backend_names():
        b = get_backend(n)
        try:
            reason = b.available()
        except Exception as e:  # availability checks must never crash a listing
            reason = f"availability check failed: {e}"
        out.append((n, reason, b.description))
    return out


def _available_here(exclude: str) -> list[str]:
    """Names of the registered backends that can run on this machine, but ``exclude``."""
    return [n for n, reason, _ in list_backends() if reason is None and n != exclude]


def select_backend(requested: str = "auto", model_format: str = "gguf",
                   kv_spec: Any = None) -> tuple[Backend, str]:
    """Pick a backend and say why.

    Args:
        requested: a backend name or "auto".
        model_format: "gguf" or "safetensors".
        kv_spec: the requested KVSpec (a backend that cannot run it is skipped by auto and
            refused when named).

    Returns:
        (backend, reason) where reason is a one-line explanation shown to the user.

    Raises:
        BackendUnavailableError: the named backend cannot run here, or none can.
        InvalidRequestError: an empty (or blank) name.
    """
    if isinstance(requested, str) and requested not in _REGISTRY:
        requested = requested.strip().lower()
        if not requested:
            from localmoe.errors import InvalidRequestError

            raise InvalidRequestError(f"backend must not be empty; use auto or one of "
                                      f"{', '.join(backend_names())}", param="backend")
    if requested and requested != "auto":
        b = get_backend(requested)
        why = b.available()
        if why:
            here = _available_here(exclude=requested)
            hint = (f"; available here: {', '.join(here)} (--backend auto picks one)" if here
                    else "")
            raise BackendUnavailableError(f"backend {requested!r} is not available: {why}{hint}")
        why = b.supports(model_format, kv_spec)
        if why:
            raise BackendUnavailableError(f"backend {requested!r} cannot run this: {why}")
        return b, f"{requested} (requested)"
    skipped = []
    for n in backend_names():
        b = get_backend(n)
        # what the backend cannot run at all comes first: "GGUF files only" for a safetensors
        # model says more than "not installed" (installing it would not help)
        why = b.supports(model_format, kv_spec) or b.available()
        if why is None:
            note = f"; skipped {', '.join(skipped)}" if skipped else ""
            return b, f"{n} (auto{note})"
        skipped.append(f"{n}: {why}")
    raise BackendUnavailableError("no backend can run this model here: " + "; ".join(skipped))


def auto_kv_fallback(requested: str | None, model_format: str, kv_spec: Any,
                     chosen: str) -> str | None:
    """Why ``auto`` passed over a backend for the KV format alone, as one line for the user
    (``the llamacpp backend cannot run the int3 KV cache; using the torch backend (slower on
    a CPU)``); None when a backend was named, or when no backend ahead of ``chosen`` in the
    auto order runs here and runs the model but for ``kv_spec``."""
    if kv_spec is None or str(requested or "auto").strip().lower() != "auto":
        return None
    for n in backend_names():
        if n == chosen:
            return None
        b = get_backend(n)
        if b.supports(model_format, None) is None and b.available() is None \
                and b.supports(model_format, kv_spec) is not None:
            slower = " (slower on a CPU)" if (n, chosen) == ("llamacpp", "torch") else ""
            what = f"the {kv_spec} KV cache"
            named = getattr(kv_spec, "named_key_grouping", None)
            # dataclasses.replace copies the fields only: the same spec without the note of
            # the grouping the user named (engine.options.parse_kv_request), i.e. its default
            unnamed = dataclasses.replace(kv_spec)
            if named and b.supports(model_format, unnamed) is None:
                # only the key grouping asked for is what it lacks: str() hides a default
                # grouping ("int4:c" is "int4"), and "cannot run int4" would say it has none
                what += f" with keys grouped per {named}"
            return f"the {n} backend cannot run {what}; using the {chosen} backend{slower}"
    return None
