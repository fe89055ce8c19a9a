"""Checks of what a caller asks the engine for, made before anything loads: context size,
KV cache format, device, sampling parameters. Each raises the :mod:`localmoe.errors` error
the CLI, the server and the Python API report."""

from __future__ import annotations

import os
import re
from typing import Any

from localmoe.errors import InvalidRequestError, LocalMoEError

DEFAULT_N_CTX = 4096


_GROUPING_NAMES = {"c": "channel", "channel": "channel", "t": "token", "token": "token"}


def named_key_grouping(kv: Any = "f16", k: str | None = None) -> str | None:
    """The key grouping the user *named* in a KV request (``"channel"`` for ``"int4:c"`` or
    ``kgroup=channel``, ``"token"`` for ``":t"`` / ``kgroup=token``), or None when the request
    leaves it to the default. Arguments as :meth:`KVSpec.parse` (``kv``, ``k``); a ``KVSpec``
    object gives None (its grouping can no longer be told apart from the default). Call it
    on a request :meth:`KVSpec.parse` accepted."""
    from localmoe.kv.formats import KVFormat

    if not isinstance(kv, str):
        return None
    k_src, base, kgroup = k, kv, None
    if "," in kv or "=" in kv:  # KVSpec's str() syntax: "int4,kgroup=channel", "k=int4:c,v=int2"
        base = None
        for part in (p.strip() for p in kv.split(",") if p.strip()):
            key, eq, val = part.partition("=")
            key = key.strip().lower()
            if not eq:
                base = key
            elif key == "k":
                k_src = k_src or val.strip()
            elif key in ("kgroup", "key_grouping"):
                kgroup = kgroup or val.strip().lower()
    if kgroup:
        return _GROUPING_NAMES.get(kgroup)
    src = k_src or base
    if not src:
        return None
    try:
        return KVFormat.parse(src).grouping or None
    except LocalMoEError:
        return None


def parse_kv_request(kv: Any = "f16", k: str | None = None, v: str | None = None):
    """:meth:`KVSpec.parse` of a user's KV request that also notes, as the spec's
    ``named_key_grouping`` attribute, the key grouping the user named (see
    :func:`named_key_grouping`; None = the format's default). Backends that can hold only one
    grouping (llamacpp: per token) refuse a grouping that was asked for and map the default.

    Raises:
        KVCacheFormatError: as :meth:`KVSpec.parse`.
    """
    from localmoe.kv.spec import KVSpec

    spec = KVSpec.parse(kv, k, v)
    if not isinstance(kv, KVSpec):
        # KVSpec is a frozen dataclass: the note is an attribute, not a field (no effect on
        # equality, hashing or str())
        object.__setattr__(spec, "named_key_grouping", named_key_grouping(kv, k))
    return spec


def device_syntax_error(device: Any) -> str | None:
    """Why ``device`` is not a device string at all (``"tpu"``, ``"cuda:abc"``, ``""``), else
    None. Well-formed strings pass, present here or not (``"cuda:7"``, ``"cpu:1"``): those are
    :func:`check_device`'s and the backend's to refuse. The command line makes this a usage
    error of ``--device`` (exit status 2)."""
    d = str(device).strip().lower()
    if d in ("cpu", "cuda") or re.fullmatch(r"(cpu|cuda):[0-9]+", d):
        return None
    return f"unknown device {device!r}; use cpu, cuda or cuda:N (N = GPU index)"


def check_device(device: Any) -> str | None:
    """Refuse a device string no backend understands, before anything loads; returns it
    normalized (``" CUDA:1"`` -> ``"cuda:1"``, ``"cpu:0"`` -> ``"cpu"``; None stays None).

    Accepted: None (the backend's default), ``"cpu"``, ``"cpu:0"`` (torch's name for the same
    device), ``"cuda"``, ``"cuda:N"`` (N a GPU index). Whether a GPU is present is the
    backend's check (:func:`check_backend_device`).

    Raises:
        InvalidRequestError: anything else (:func:`device_syntax_error`), ``"cpu:N"`` with
            N > 0 included (there is one CPU device) (``param="device"``).
    """
    if device is None:
        return None
    why = device_syntax_error(device)
    if why:
        raise InvalidRequestError(why, param="device")
    d = str(device).strip().lower()
    if d.startswith("cpu:"):
        if int(d[4:]) == 0:
            return "cpu"
        raise InvalidRequestError(f"device {device!r} does not exist: there is one CPU device "
                                  f"(cpu, or cpu:0)", param="device")
    return d


def check_backend_device(backend: Any, device: Any) -> None:
    """Refuse a ``device`` (accepted by :func:`check_device`) that does not exist here for
    ``backend`` (a registry Backend: its ``check_device``), before any weights load:
    ``cuda`` without a visible CUDA device, ``cuda:N`` beyond the devices there are.

    Raises:
        InvalidRequestError: the backend's reason (``param="device"``).
    """
    check = getattr(backend, "check_device", None)
    why = check(device) if device is not None and check is not None else None
    if why:
        raise InvalidRequestError(why, param="device")


def make_sampling_params(params: Any = None, **sampling: Any):
    """Build and validate a ``SamplingParams`` from ``params`` (a SamplingParams; None = the
    library defaults) with keyword overrides of its fields (None values ignored except
    ``seed`` and ``max_tokens``; a string ``stop`` becomes a one-element tuple).

    Raises:
        InvalidRequestError: unknown parameter name or out-of-range value.
    """
    import dataclasses

    from localmoe.engine.sampling import SamplingParams

    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"params must be a SamplingParams (or None; sampling fields go as keyword "
            f"arguments), got {type(params).__name__}", param="params")
    if sampling:
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(set(sampling) - names)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}",
                param=unknown[0])
        sampling = {k: v for k, v in sampling.items() if v is not None or k in ("seed", "max_tokens")}
        if "stop" in sampling and isinstance(sampling["stop"], str):
            sampling["stop"] = (sampling["stop"],)
        params = dataclasses.replace(params, **sampling)
    params.validate()
    return params


def check_n_ctx(n_ctx: Any) -> None:
    """Refuse a context size that is not a positive integer (None = the model's default).

    Raises:
        InvalidRequestError: ``param="n_ctx"``.
    """
    if n_ctx is not None and (not isinstance(n_ctx, int) or n_ctx < 1):
        raise InvalidRequestError(f"context size must be a positive integer, got {n_ctx!r}",
                                  param="n_ctx")


def context_size(n_ctx: int | None, n_ctx_train: int | None) -> int:
    """The context size (tokens) to load a model with: ``n_ctx`` when given, else
    min(the model's training context ``n_ctx_train``, :data:`DEFAULT_N_CTX`).

    Raises:
        InvalidRequestError: ``n_ctx`` is larger than a known training context
            (``param="n_ctx"``).
    """
    n_train = int(n_ctx_train or 0)
    if n_ctx and n_train and n_ctx > n_train:
        raise InvalidRequestError(
            f"context size {n_ctx} is larger than the model's training context of {n_train} "
            f"tokens; use a context size of at most {n_train}", param="n_ctx")
    return int(n_ctx) if n_ctx else min(int(n_ctx_train or DEFAULT_N_CTX), DEFAULT_N_CTX)


def check_act_env() -> None:
    """Raise InvalidRequestError for a ``$LOCALMOE_ACT_PRECISION`` that is not ``int8`` or
    ``int16`` (the triton backend's activation precision, ``--act-precision``), before any
    weights load; the kernels' module (and Triton) is imported only when the variable is set."""
    if os.environ.get("LOCALMOE_ACT_PRECISION", "").strip():
        from localmoe.kernels.quant_gemv import act_precision

        act_precision()
