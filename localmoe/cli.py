"""``localmoe`` command line (click).

The CLI is thin: it parses flags, resolves the model through the store and calls the engine,
the TUI or the server. Heavy modules (torch, the engine, backends) are imported inside the
commands so ``localmoe --help`` stays fast. Errors a user can cause (``LocalMoEError``) print one
line ``error: ...`` on stderr and exit with status 1; Ctrl-C stops generation cleanly and exits
with status 130; usage errors exit with status 2 (click's convention).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any

import click

from localmoe import __version__
from localmoe.errors import LocalMoEError
from localmoe.engine.registry import MAX_THREADS

KV_CHOICES_HELP = "f16|bf16|f32|int8|int4|int3|int2|fp4 (optionally ':gN' group size)"
KV_FORMATS = ("f16", "bf16", "int8", "int4", "int3", "int2", "fp4")
# what `info` lists: every format under its plain name (its default key grouping: per token for
# int8, per channel for int4/int3/int2) and the int formats with the other key grouping too
KV_INFO_FORMATS = ("f16", "bf16", "int8", "int8:c", "int4", "int4:t", "int3", "int3:t", "int2",
                   "int2:t", "fp4")


class _Group(click.Group):
    """Click group that turns user errors into one line and Ctrl-C into exit status 130."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LocalMoEError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(1)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            ctx.exit(130)
        except BrokenPipeError:  # `localmoe generate ... | head`
            try:
                sys.stdout = open(os.devnull, "w")
            except OSError:
                pass
            ctx.exit(0)


class _UsageError(click.UsageError):
    """A usage error of our own (a missing or empty prompt): exit status 2 like click's, shown
    as the one line ``error: ...`` of the project's other errors (not click's usage block and
    ``Error:``)."""

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", file=file, err=file is None)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="localmoe")
def cli() -> None:
    """localmoe: fast local inference for Mixture-of-Experts language models.

    \b
    Quick start:
      localmoe generate "Why is the sky blue?"      one-shot answer (default model)
      localmoe chat -m smollm2                      terminal chat UI
      localmoe serve -m FILE.gguf --port 8000       OpenAI-compatible server
      localmoe pull gemma3-270m | hf:OWNER/REPO/FILE.gguf | PATH
      localmoe info MODEL                           architecture, experts, quant mix, KV sizes
      localmoe backends                             which backends run here, and why not
    """


# ---- shared options --------------------------------------------------------------------------
# what each command loads without -m: generate, serve and bench the store's DEFAULT_MODEL; chat
# the continued chat's model, else the one it loaded last (the chat UI remembers it), else that
MODEL_DEFAULT_HELP = "smollm2 (pulled on first use)"
CHAT_MODEL_DEFAULT_HELP = ("with --continue the reopened chat's model, else the model chat "
                           "loaded last, else smollm2 (pulled on first use)")


def _model_options(f=None, *, model_default: str = MODEL_DEFAULT_HELP):
    if f is None:  # @_model_options(model_default=...)
        return lambda g: _model_options(g, model_default=model_default)
    opts = [
        click.option("-m", "--model", default=None, metavar="MODEL",
                     help="Model file (.gguf, any shard), HF folder, store name, or "
                          f"hf:OWNER/REPO/FILE. Default: {model_default}."),
        click.option("--backend", default="auto", show_default=True, metavar="NAME",
                     help="Backend: auto, triton, llamacpp, torch (see `localmoe backends`)."),
        click.option("-c", "--ctx-size", "n_ctx", type=click.IntRange(min=1), default=None,
                     help="Context size in tokens (default: model's, at most 4096)."),
        click.option("--kv-cache", default="f16", show_default=True, metavar="FMT",
                     help=f"KV cache format for keys and values: {KV_CHOICES_HELP}."),
        click.option("--kv-cache-k", default=None, metavar="FMT", help="Key cache format (overrides --kv-cache)."),
        click.option("--kv-cache-v", default=None, metavar="FMT", help="Value cache format (overrides --kv-cache)."),
        click.option("--device", default=None, help="Device for the backend: cpu, cuda, cuda:N."),
        click.option("-t", "--threads", type=click.IntRange(min=1, max=MAX_THREADS), default=None,
                     metavar="N",
                     expose_value=False, callback=_set_threads,
                     help="CPU threads of the torch and llamacpp backends (sets LOCALMOE_THREADS). "
                          "Default: torch, the physical cores minus those other processes keep "
                          "busy while the model loads; llamacpp, half the logical CPUs."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _set_threads(ctx: click.Context, param: click.Parameter, value: int | None) -> None:
    if value is not None:  # the backends read it when they load (the chat UI's too)
        os.environ["LOCALMOE_THREADS"] = str(value)


def _sampling_options(f):
    opts = [
        click.option("--temperature", "--temp", "temperature", type=float, default=None,
                     help="Sampling temperature (0 = greedy). Default 0.8."),
        click.option("--top-k", type=int, default=None, help="Keep the k most likely tokens (0 = off). Default 40."),
        click.option("--top-p", type=float, default=None, help="Nucleus sampling mass. Default 0.95."),
        click.option("--min-p", type=float, default=None, help="Drop tokens below min_p x top probability. Default 0.05."),
        click.option("--repeat-penalty", type=float, default=None, help="Repetition penalty (1 = off)."),
        click.option("--repeat-last-n", type=int, default=None, help="Tokens the repetition penalty looks back."),
        click.option("--frequency-penalty", type=float, default=None, help="OpenAI-style frequency penalty."),
        click.option("--presence-penalty", type=float, default=None, help="OpenAI-style presence penalty."),
        click.option("--seed", type=int, default=None, help="Random seed (same seed, same output)."),
        click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=None,
                     help="Stop after this many generated tokens (default: until the end or the context is full)."),
        click.option("--stop", multiple=True, metavar="TEXT", help="Stop string (repeatable)."),
        click.option("--greedy", is_flag=True, help="Greedy decoding (same as --temperature 0)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _sampling_kwargs(kw: dict) -> dict:
    keys = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
            "frequency_penalty", "presence_penalty", "seed", "max_tokens")
    out = {k: kw.pop(k) for k in keys if kw.get(k) is not None}
    for k in keys:
        kw.pop(k, None)
    stop = kw.pop("stop", ())
    if stop:
        out["stop"] = tuple(stop)
    if kw.pop("greedy", False):
        out["temperature"] = 0.0
    return out


def _stop_now(signum, frame) -> None:
    """SIGINT handler of the start-up phase: print ``interrupted`` and exit at once (130)."""
    try:
        sys.stderr.write("\ninterrupted\n")
        sys.stderr.flush()
    finally:
        os._exit(130)


def _interruptible() -> None:
    """End of the start-up phase: Ctrl-C raises KeyboardInterrupt again, so generation stops
    cleanly (:class:`_Group` prints ``interrupted``, status 130)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _load_llm(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device, verbose=False,
              before_load=None):
    def progress(frac: float, msg: str) -> None:
        if verbose:
            click.echo(f"[{frac * 100:3.0f}%] {msg}", err=True)

    from localmoe.api import LLM

    llm = LLM(model, backend=backend, n_ctx=n_ctx, kv_cache=kv_cache, kv_cache_k=kv_cache_k,
              kv_cache_v=kv_cache_v, device=device, progress=progress, before_load=before_load)
    _interruptible()
    if verbose:
        st = llm.stats()
        threads = (f" | threads {st['n_threads']}" + (f" ({st['threads_reason']})"
                                                       if st.get("threads_reason") else "")
                   if st.get("n_threads") else "")
        click.echo(f"model {llm.model_name} | backend {llm.backend_reason} | context {llm.n_ctx} "
                   f"| kv {llm.kv_spec}{threads}", err=True)
    return llm


# ---- generate --------------------------------------------------------------------------------
@cli.command()
@click.argument("prompt", required=False)
@_model_options
@_sampling_options
@click.option("--raw", is_flag=True, help="Plain-text completion: do not apply the chat template.")
@click.option("--system", default=None, metavar="TEXT",
              help="System message. A model without a chat template gets a plain "
                   "System:/User:/Assistant: transcript (with a warning); ignored with --raw.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, tokens, finish reason, timings) instead of streaming.")
@click.option("-v", "--verbose", is_flag=True, help="Print loading steps and timings on stderr.")
def generate(prompt, model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device, raw,
             system, as_json, verbose, **kw):
    """Generate a reply to PROMPT (or stdin) and stream it to stdout.

    The model's chat template is applied when it has one (as `ollama run` does); --raw sends
    the text as is for plain completion.
    """
    sampling = _sampling_kwargs(kw)
    from localmoe.engine.options import make_sampling_params

    make_sampling_params(None, **sampling)  # out-of-range values fail before the weights load
    if prompt is None or prompt == "-":
        if sys.stdin.isatty() and prompt is None:
            raise _UsageError("no prompt; give a PROMPT argument or pipe the prompt on stdin")
        prompt = sys.stdin.read().rstrip("\r\n")  # `echo hi |` adds a newline
    if not prompt.strip():
        raise _UsageError("the prompt is empty; give a PROMPT argument or pipe the prompt on "
                          "stdin")
    if raw and system:
        click.echo("warning: --system is ignored with --raw (plain completion sends the prompt "
                   "as is); put the system text into the prompt instead", err=True)
    msgs = ([{"role": "system", "content": system}] if system else []) + \
           [{"role": "user", "content": prompt}]

    def plain(llm) -> bool:  # a plain completion of the prompt (else a chat turn)
        return raw or (llm.template is None and not system)

    def fits(llm) -> None:  # a prompt over the context is refused before the weights load
        from localmoe.errors import ContextOverflowError

        n = len(llm.prompt_ids(prompt) if plain(llm) else llm.prompt_ids(messages=msgs))
        if n > llm.n_ctx:
            raise ContextOverflowError(n, llm.n_ctx)

    llm = _load_llm(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device, verbose,
                    before_load=fits)
    try:
        if plain(llm):
            events = llm.generate(prompt, stream=True, raw=True, **sampling)
        else:
            if llm.template is None:
                # llama.cpp warns and falls back to chatml here; for a model without a template
                # (a base model) a plain transcript is what it can continue, and it is what
                # `chat` and `serve` send this model too
                click.echo(f"warning: {llm.model_name} has no chat template; --system and the "
                           f"prompt are sent as a plain 'System: ...' / 'User: ...' / "
                           f"'Assistant:' transcript (as chat and serve do); drop --system for "
                           f"a plain completion of the prompt", err=True)
            events = llm.chat_stream(msgs, make_sampling_params(llm.default_sampling(), **sampling))
        result = None
        out = sys.stdout
        wrote_nl = True
        parts: list[str] = []
        try:
            for ev in events:
                if ev.done:
                    result = ev.result
                elif not as_json:
                    out.write(ev.delta)
                    out.flush()
                    wrote_nl = ev.delta.endswith("\n")
                else:
                    parts.append(ev.delta)
        except KeyboardInterrupt:
            if as_json:  # keep what was generated: one JSON object, then exit 130
                click.echo(json.dumps({"model": llm.model_name, "backend": llm.backend_name,
                                       "n_ctx": llm.n_ctx, "kv_cache": str(llm.kv_spec),
                                       "text": "".join(parts), "finish_reason": "cancelled"},
                                      ensure_ascii=False))
            raise
        finally:
            close = getattr(events, "close", None)
            if close:
                close()
            if not as_json and not wrote_nl:
                out.write("\n")
                out.flush()
        if as_json:
            d = {"model": llm.model_name, "backend": llm.backend_name, "n_ctx": llm.n_ctx,
                 "kv_cache": str(llm.kv_spec)}
            d.update(result.to_dict())
            click.echo(json.dumps(d, ensure_ascii=False))
        elif verbose and result is not None:
            t = result.timings
            click.echo(f"[{result.finish_reason}] prompt {result.prompt_tokens} tok "
                       f"({t.prefill_tok_s:.1f} tok/s) | {result.completion_tokens} tok, TTFT "
                       f"{t.ttft_ms:.0f} ms, TPOT {t.tpot_ms:.1f} ms, {t.decode_tok_s:.1f} tok/s",
                       err=True)
    finally:
        llm.close()


# ---- chat / serve ----------------------------------------------------------------------------
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
    KV format, device, $LOCALMOE_THREADS, model file, backend, context size. Raises the same
    LocalMoEError."""
    from localmoe.engine.options import check_backend_device, check_device, parse_kv_request
    from localmoe.engine.registry import env_threads, select_backend

    kv_spec = parse_kv_request(kv_cache, kv_cache_k, kv_cache_v)
    check_device(device)
    env_threads()
    if model is None:  # the default / last / continued model is found (or pulled) by the UI
        if backend and backend != "auto":
            check_backend_device(select_backend(backend, "gguf", kv_spec)[0], device)
        elif device is not None:  # the backend auto picks for a GGUF model (the store's kind)
            check_backend_device(select_backend("auto", "gguf", kv_spec)[0], device)
        return
    from localmoe.errors import InvalidRequestError
    from localmoe.io.loader import open_model
    from localmoe.io.store import resolve_model

    mf = open_model(resolve_model(model))
    try:
        check_backend_device(select_backend(backend or "auto", mf.format, kv_spec)[0], device)
        n_train = int(mf.spec.n_ctx_train or 0)
        if n_ctx and n_train and n_ctx > n_train:
            raise InvalidRequestError(
                f"context size {n_ctx} is larger than the model's training context of {n_train} "
                f"tokens; use a context size of at most {n_train}", param="n_ctx")
    finally:
        mf.close()


@cli.command()
@_model_options(model_default=CHAT_MODEL_DEFAULT_HELP)
@click.option("--continue", "continue_last", is_flag=True, help="Reopen the most recent chat.")
@click.option("--list", "list_chats", is_flag=True, help="List saved chats and exit.")
def chat(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device, continue_last,
         list_chats):
    """Open the terminal chat UI.

    Takes the model, backend, context, KV cache and device options of `generate`; a bad value
    is an error here, before the UI opens and before any weights load.
    """
    from localmoe.tui import app as tui_app

    if list_chats:
        click.echo(tui_app.list_chats_text())
        return
    _precheck(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device)
    kwargs = dict(backend=backend, n_ctx=n_ctx, kv_cache=_combined_kv(kv_cache, kv_cache_k, kv_cache_v),
                  continue_last=continue_last)
    if device is not None:
        kwargs["device"] = device
    _interruptible()  # the UI takes Ctrl-C as a key; never exit under it with a raw terminal
    tui_app.run_chat(model, **kwargs)


@cli.command()
@_model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--api-key", default=None, envvar="LOCALMOE_API_KEY",
              help="Require this bearer token (env LOCALMOE_API_KEY).")
def serve(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device, host, port, api_key):
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, ...)."""
    from localmoe.kv.spec import KVSpec

    KVSpec.parse(kv_cache, kv_cache_k, kv_cache_v)
    import localmoe.serve.server as server

    kwargs = dict(host=host, port=port, api_key=api_key, backend=backend, n_ctx=n_ctx,
                  kv_cache=kv_cache, kv_cache_k=kv_cache_k, kv_cache_v=kv_cache_v)
    if device is not None:
        kwargs["device"] = device
    try:
        server.run_server(model, **kwargs)
    except OSError as e:
        raise LocalMoEError(f"cannot serve on {host}:{port}: {e.strerror or e}; "
                            f"pick another --port or stop the other server") from e


# ---- store -----------------------------------------------------------------------------------
@cli.command()
@click.argument("source")
@click.option("--force", is_flag=True, help="Download again even if already stored.")
@click.option("--link", is_flag=True, help="For a local file: register it in place instead of copying.")
def pull(source, force, link):
    """Fetch a model into the store: NAME (smollm2, gemma3-270m), hf:OWNER/REPO/FILE.gguf or PATH."""
    from localmoe.io.store import ModelStore, format_size

    st = ModelStore()
    m = st.pull(source, force=force, link=link)
    click.echo(f"{m.name}: {m.path} ({format_size(m.size)}, sha256 {m.sha256[:12] or '-'})")


@cli.command("models")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def models_cmd(as_json):
    """List the models in the store (and the pullable short names)."""
    from localmoe.io.store import CATALOG, ModelStore, format_size

    st = ModelStore()
    items = st.list(include_missing=True)
    if as_json:
        click.echo(json.dumps([{"name": m.name, "path": str(m.path), "size": m.size,
                                "sha256": m.sha256, "source": m.source, "missing": m.missing}
                               for m in items], indent=1))
        return
    click.echo(f"store: {st.models_dir}")
    if items:
        w = max(len(m.name) for m in items)
        for m in items:
            size = "missing" if m.missing else format_size(m.size)
            click.echo(f"  {m.name:<{w}}  {size:>10}  {m.source}")
    else:
        click.echo("  (empty)")
    gone = [m.name for m in items if m.missing]
    if gone:
        click.echo(f"missing: the files of {', '.join(gone)} are gone; pull "
                   f"{'it' if len(gone) == 1 else 'them'} again or `localmoe rm NAME`")
    missing = [e for n, e in CATALOG.items() if st.find(n) is None]
    if missing:
        click.echo("pullable: " + ", ".join(f"{e.name} ({e.description})" for e in missing))


@cli.command()
@click.argument("name")
def rm(name):
    """Delete a model from the store."""
    from localmoe.io.store import ModelStore, format_size

    m = ModelStore().remove(name)
    if m.shared_with:
        note = f" (files kept: also used by {', '.join(m.shared_with)})"
    elif m.missing:
        note = " (its files were gone already)"
    elif m.linked:
        note = ""
    else:
        note = f" ({format_size(m.size)} freed)"
    click.echo(f"removed {m.name}{note}")


# ---- info / backends -------------------------------------------------------------------------
def model_info(model_file) -> dict[str, Any]:
    """Facts about a model for ``localmoe info`` (pure; used by tests).

    Returns a dict with: name, path, format, architecture, params_total, params_active,
    n_experts, top_k, n_shared_experts, d_ff_expert, n_layers, d_model, n_heads, n_kv_heads,
    head_dim, context (training context in tokens), n_ctx_default (the context a run gets
    without --ctx-size, tokens), chat_template (bool), quant_mix ({qtype: {"tensors": n,
    "bytes": b}}), kv_bytes_per_token ({format: bytes per token or None}, formats of
    :data:`KV_INFO_FORMATS`: ``"int4"`` is the default per-channel keys, ``"int4:t"`` per-token
    keys), kv_key_grouping ({format: "channel" | "token" | None for float/fp4 keys}).
    """
    from localmoe.kv.spec import KVSpec

    spec = model_file.spec
    total = 0
    expert = 0
    mix: dict[str, dict[str, int]] = {}
    for name in model_file.tensor_names():
        ti = model_file.tensor_info(name)
        n = 1
        for d in ti.shape:
            n *= int(d)
        total += n
        if "_exps." in name:
            expert += n
        q = mix.setdefault(str(ti.qtype), {"tensors": 0, "bytes": 0})
        q["tensors"] += 1
        q["bytes"] += int(ti.nbytes)
    active = total
    if spec.n_experts and expert:
        active = total - expert + expert * spec.top_k // spec.n_experts
    kv: dict[str, float | None] = {}
    grouping: dict[str, str | None] = {}
    for fmt in KV_INFO_FORMATS:
        try:
            kvs = KVSpec.parse(fmt)
            grouping[fmt] = kvs.k.grouping or None
            kv[fmt] = kvs.bytes_per_token(spec)
        except LocalMoEError:
            kv[fmt] = None
    from localmoe.engine.options import DEFAULT_N_CTX

    n_ctx_default = min(int(spec.n_ctx_train or DEFAULT_N_CTX), DEFAULT_N_CTX)
    return {
        "name": model_file.name, "path": str(model_file.path), "format": model_file.format,
        "architecture": spec.arch, "params_total": total, "params_active": active,
        "n_experts": spec.n_experts, "top_k": spec.top_k, "n_shared_experts": spec.n_shared_experts,
        "d_ff_expert": spec.d_ff_expert, "n_layers": spec.n_layers, "d_model": spec.d_model,
        "n_heads": spec.n_heads, "n_kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size, "context": spec.n_ctx_train, "n_ctx_default": n_ctx_default,
        "sliding_window": spec.sliding_window,
        "chat_template": bool(model_file.chat_template), "quant_mix": mix,
        "kv_bytes_per_token": kv, "kv_key_grouping": grouping,
    }


def _fmt_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


@cli.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def info(model, as_json):
    """Show a model's architecture, parameters, experts, quant mix, context, template and the
    KV cache bytes per token of every format."""
    from localmoe.io.loader import open_model
    from localmoe.io.store import ModelStore, format_size

    mf = open_model(ModelStore().resolve(model))
    d = model_info(mf)
    if as_json:
        click.echo(json.dumps(d, indent=1))
        return
    moe = (f"{d['n_experts']} experts, top-{d['top_k']}, d_ff_expert {d['d_ff_expert']}"
           + (f", {d['n_shared_experts']} shared" if d["n_shared_experts"] else "")
           if d["n_experts"] else "none (dense)")
    rows = [
        ("model", f"{d['name']}  ({d['path']})"),
        ("format", d["format"]),
        ("architecture", d["architecture"]),
        ("parameters", f"{_fmt_count(d['params_total'])} total, {_fmt_count(d['params_active'])} active per token"),
        ("experts", moe),
        ("shape", f"{d['n_layers']} layers, d_model {d['d_model']}, {d['n_heads']} q / "
                  f"{d['n_kv_heads']} kv heads, head_dim {d['head_dim']}, vocab {d['vocab_size']}"),
        ("context", f"{d['context']} tokens" + (f" (sliding window {d['sliding_window']})"
                                                 if d["sliding_window"] else "")),
        ("chat template", "yes" if d["chat_template"] else "no"),
        ("quant mix", ", ".join(f"{q}: {v['tensors']} tensor{'s' if v['tensors'] != 1 else ''} {format_size(v['bytes'])}"
                                for q, v in sorted(d["quant_mix"].items(),
                                                   key=lambda kv: -kv[1]["bytes"]))),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{w}}  {v}")
    n_def, n_full = d["n_ctx_default"], d["context"] or d["n_ctx_default"]
    click.echo(f"KV cache of one sequence (--kv-cache FMT; keys grouped per channel ':c' or per "
               f"token ':t'):")
    click.echo(f"  {'format':<7} {'keys':<11} {'bytes/token':>11}  {f'{n_def} tok':>10}"
               f"  {f'{n_full} tok':>10}")
    for fmt, b in d["kv_bytes_per_token"].items():
        g = d["kv_key_grouping"].get(fmt)
        keys = {"channel": "per channel", "token": "per token"}.get(g, "-")
        if b is None:
            click.echo(f"  {fmt:<7} {keys:<11} (not available in this build)")
        else:
            click.echo(f"  {fmt:<7} {keys:<11} {b:>11,.0f}  {format_size(b * n_def):>10}"
                       f"  {format_size(b * n_full):>10}")
    click.echo(f"  ({n_def}: the default context, allocated without --ctx-size; {n_full}: the "
               f"training context)")


@cli.command()
def backends():
    """List backends, whether each can run here, and which one `auto` picks for GGUF."""
    from localmoe.engine.registry import list_backends, select_backend

    rows = list_backends()
    w = max((len(n) for n, _, _ in rows), default=4)
    for name, reason, desc in rows:
        status = "available" if reason is None else f"unavailable: {reason}"
        click.echo(f"{name:<{w}}  {status}")
        click.echo(f"{'':<{w}}  {desc}")
    for fmt in ("gguf", "safetensors"):
        try:
            _, why = select_backend("auto", fmt)
            click.echo(f"auto for {fmt}: {why}")
        except LocalMoEError as e:
            click.echo(f"auto for {fmt}: none ({e})")


# ---- bench -----------------------------------------------------------------------------------
@cli.command()
@_model_options
@click.option("-p", "--prompt-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("-n", "--gen-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("-r", "--repeat", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Also write the results to this JSON file.")
def bench(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device, prompt_tokens,
          gen_tokens, repeat, json_out):
    """Measure prefill and decode speed (greedy, fixed lengths, median of repeats)."""
    import platform
    import statistics

    if json_out:  # refuse an unwritable --json path before minutes of benchmarking
        parent = os.path.dirname(os.path.abspath(json_out))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise LocalMoEError(f"cannot write {json_out}: {parent} is not a writable folder")
    llm = _load_llm(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device)
    try:
        # ~10 tokens per sentence: enough sentences for any --prompt-tokens
        text = ("The quick brown fox jumps over the lazy dog. " * max(400, prompt_tokens // 5))
        ids = llm.tokenizer.encode(text, add_special=False)[:prompt_tokens]
        if len(ids) + gen_tokens > llm.n_ctx:
            raise LocalMoEError(f"prompt {len(ids)} + {gen_tokens} tokens exceed the context "
                                f"{llm.n_ctx}; lower -p/-n or raise --ctx-size")
        runs = []
        llm.generate(ids[:8], max_tokens=4, temperature=0.0)  # warm-up
        for i in range(repeat):
            llm.reset()
            # end-of-generation tokens biased away: every run decodes exactly gen_tokens
            r = llm.generate(ids, max_tokens=gen_tokens, temperature=0.0,
                             logit_bias={i: -100.0 for i in llm.tokenizer.eog_ids})
            runs.append(r)
        med = lambda xs: statistics.median(xs)
        tp = sorted(r.timings.tpot_ms for r in runs)
        res = {
            "model": llm.model_name, "backend": llm.backend_name, "device": llm.stats().get("device"),
            "machine": platform.node(), "cpu_count": os.cpu_count(),
            "threads": llm.stats().get("n_threads"), "kv_cache": str(llm.kv_spec),
            "prompt_tokens": len(ids), "gen_tokens": min(r.completion_tokens for r in runs),
            "repeat": repeat,
            "ttft_ms": med([r.timings.ttft_ms for r in runs]),
            "tpot_ms_median": med(tp), "tpot_ms_p90": tp[min(len(tp) - 1, int(0.9 * len(tp)))],
            "decode_tok_s": med([r.timings.decode_tok_s for r in runs]),
            "prefill_tok_s": med([r.timings.prefill_tok_s for r in runs]),
            "kv_bytes_per_token": llm.kv_spec.bytes_per_token(llm.spec) if llm.spec else None,
        }
    finally:
        llm.close()
    for k, v in res.items():
        click.echo(f"{k:<20} {v:.2f}" if isinstance(v, float) else f"{k:<20} {v}")
    if json_out:
        try:
            with open(json_out, "w") as f:
                json.dump(res, f, indent=1)
        except OSError as e:
            raise LocalMoEError(f"cannot write {json_out}: {e.strerror or e}") from None


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``localmoe``).

    Until a command starts its interruptible work (generation, the chat UI, the server's own
    handlers), Ctrl-C exits at once with status 130 (:func:`_stop_now`): nothing is lost yet,
    and a KeyboardInterrupt raised while torch, numpy, triton or llama.cpp import can leave a
    module half initialised or abort the process from C++.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _stop_now)
    cli.main(args=argv, prog_name="localmoe")


if __name__ == "__main__":  # pragma: no cover
    main()
