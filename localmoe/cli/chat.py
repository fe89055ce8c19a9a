"""``localmoe chat``: the terminal chat UI (:mod:`localmoe.tui`), checked before it opens."""

from __future__ import annotations

import signal
import sys

import click

from localmoe.cli.options import (
    CHAT_MODEL_DEFAULT_HELP, auto_note, interruptible, model_options,
)


def _combined_kv(kv_cache: str, kv_cache_k: str | None, kv_cache_v: str | None) -> str:
    """One KV string with the -k/-v overrides in front (``"k=int4,v=int2,f16"``):
    ``KVSpec.parse`` of it equals ``KVSpec.parse(kv_cache, kv_cache_k, kv_cache_v)`` and the
    user's own words (an explicit ``:c`` key grouping, say) stay as they were typed."""
    parts = ([f"k={kv_cache_k}"] if kv_cache_k else []) + ([f"v={kv_cache_v}"] if kv_cache_v else [])
    if not parts:
        return kv_cache
    # an override replaces the string's own k=/v= (a spec names each option once)
    drop = ("k=" if kv_cache_k else "\0", "v=" if kv_cache_v else "\0")
    rest = [p for p in kv_cache.split(",") if not p.strip().lower().replace(" ", "").startswith(drop)]
    return ",".join(parts + rest) if any(p.strip() for p in rest) else ",".join(parts)


def _precheck(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device):
    """The checks ``LLM`` makes before loading weights, for commands that load later (chat):
    KV format, device, $LOCALMOE_THREADS, $LOCALMOE_ACT_PRECISION, model file, backend, context size. Raises the same
    LocalMoEError; and the TemplateError of a chat template that does not compile (``LLM``
    loads such a model for plain completions, but a chat has no use for it)."""
    from localmoe.engine.options import (check_act_env, check_backend_device, check_device,
                                         parse_kv_request)
    from localmoe.backends.registry import env_threads, select_backend

    kv_spec = parse_kv_request(kv_cache, kv_cache_k, kv_cache_v)
    device = check_device(device)
    env_threads()
    check_act_env()
    if model is None:  # the default / last / continued model is found (or pulled) by the UI
        if backend and backend != "auto":
            check_backend_device(select_backend(backend, "gguf", kv_spec)[0], device)
            return
        be = select_backend("auto", "gguf", kv_spec)[0]  # auto's pick for a GGUF model (the
        if device is not None:                           # store's kind)
            check_backend_device(be, device)
        auto_note(backend, "gguf", kv_spec, be.name)   # before the UI opens
        return
    from localmoe.errors import InvalidRequestError
    from localmoe.io.loader import open_model
    from localmoe.io.store import resolve_model

    mf = open_model(resolve_model(model))
    try:
        kv_spec.check_head_dims(mf.spec.head_dim, mf.spec.v_head_dim)
        be = select_backend("auto" if backend is None else backend, mf.format, kv_spec)[0]
        check_backend_device(be, device)
        n_train = int(mf.spec.n_ctx_train or 0)
        if n_ctx and n_train and n_ctx > n_train:
            raise InvalidRequestError(
                f"context size {n_ctx} is larger than the model's training context of {n_train} "
                f"tokens; use a context size of at most {n_train}", param="n_ctx")
        from localmoe.errors import TemplateError
        from localmoe.text.chat_template import ChatTemplate

        err = ChatTemplate.compile_error(mf)   # (none: a base model chats in a plain transcript)
        if err is not None:
            raise TemplateError(err)
        auto_note(backend, mf.format, kv_spec, be.name)
    finally:
        mf.close()


@click.command()
@model_options(model_default=CHAT_MODEL_DEFAULT_HELP)
@click.option("--continue", "continue_last", is_flag=True, help="Reopen the most recent chat.")
@click.option("--list", "list_chats", is_flag=True, help="List saved chats and exit.")
def chat(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device, continue_last,
         list_chats):
    """Open the terminal chat UI.

    Takes the model, backend, context, KV cache and device options of `generate`; a bad value
    is an error here, before the UI opens and before any weights load.
    """
    if list_chats and continue_last:  # --list exits before any chat opens: say so
        raise click.UsageError("--list and --continue cannot be combined (--list lists the "
                               "saved chats and exits); give one of them")
    from localmoe.tui import app as tui_app

    if list_chats:
        click.echo(tui_app.list_chats_text())
        return
    _precheck(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device)
    kwargs = dict(backend=backend, n_ctx=n_ctx, kv_cache=_combined_kv(kv_cache, kv_cache_k, kv_cache_v),
                  continue_last=continue_last)
    if device is not None:
        kwargs["device"] = device
    interruptible()  # the UI takes Ctrl-C as a key; never exit under it with a raw terminal
    code = tui_app.run_chat(model, **kwargs)
    if isinstance(code, int) and code:   # SIGTERM / SIGHUP quit the UI (terminal restored)
        names = {128 + signal.SIGTERM: "terminated"}
        if hasattr(signal, "SIGHUP"):
            names[128 + signal.SIGHUP] = "hangup"
        click.echo(names.get(code, f"exit status {code}"), err=True)
        sys.exit(code)
