"""Options, helpers and user messages shared by the ``localmoe`` commands.

Nothing heavy is imported here (the engine is imported by :func:`load_llm` when it runs), so
``localmoe --help`` stays fast.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import click

from localmoe.cpu.threads import MAX_THREADS
from localmoe.io.console import stderr_is_terminal

KV_CHOICES_HELP = "f16|bf16|f32|int8|int4|int3|int2|fp4 (optionally ':gN' group size)"
# what `info` lists: every format under its plain name (its default key grouping: per token for
# int8, per channel for int4/int3/int2) and the int formats with the other key grouping too
KV_INFO_FORMATS = ("f16", "bf16", "f32", "int8", "int8:c", "int4", "int4:t", "int3", "int3:t",
                   "int2", "int2:t", "fp4")



class OneLineUsageError(click.UsageError):
    """A usage error of our own (a missing or empty prompt): exit status 2 like click's, shown
    as the one line ``error: ...`` of the project's other errors (not click's usage block and
    ``Error:``)."""

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", file=file, err=file is None)


# what each command loads without -m: generate, serve and bench the store's DEFAULT_MODEL; chat
# the continued chat's model, else the one it loaded last (the chat UI remembers it), else that
MODEL_DEFAULT_HELP = "smollm2 (pulled on first use)"
CHAT_MODEL_DEFAULT_HELP = ("with --continue the reopened chat's model, else the model chat "
                           "loaded last, else smollm2 (pulled on first use)")


def model_options(f=None, *, model_default: str = MODEL_DEFAULT_HELP):
    if f is None:  # @model_options(model_default=...)
        return lambda g: model_options(g, model_default=model_default)
    opts = [
        click.option("-m", "--model", default=None, metavar="MODEL", callback=check_model_name,
                     help="Model file (.gguf, any shard), HF folder, store name, or "
                          f"hf:OWNER/REPO/FILE. Default: {model_default}."),
        click.option("--backend", default="auto", show_default=True, metavar="NAME",
                     callback=_check_backend,
                     help="Backend: auto, triton, llamacpp, torch (see `localmoe backends`)."),
        click.option("-c", "--ctx-size", "--n-ctx", "n_ctx", type=click.IntRange(min=1), default=None,
                     help="Context size in tokens (default: model's, at most 4096)."),
        click.option("--kv-cache", default="f16", show_default=True, metavar="FMT",
                     callback=_check_kv,
                     help=f"KV cache format for keys and values: {KV_CHOICES_HELP}."),
        click.option("--kv-cache-k", default=None, metavar="FMT", callback=_check_kv,
                     help="Key cache format (overrides --kv-cache)."),
        click.option("--kv-cache-v", default=None, metavar="FMT", callback=_check_kv,
                     help="Value cache format (overrides --kv-cache)."),
        click.option("--device", default=None, callback=_check_device,
                     help="Device for the backend: cpu, cuda, cuda:N."),
        click.option("-t", "--threads", type=click.IntRange(min=1, max=MAX_THREADS), default=None,
                     metavar="N",
                     expose_value=False, callback=_set_threads,
                     help="CPU threads of the torch and llamacpp backends (sets LOCALMOE_THREADS). "
                          "Default: torch, the physical cores minus those other processes keep "
                          "busy while the model loads; llamacpp, half the logical CPUs."),
        click.option("--no-cuda-graph", is_flag=True, expose_value=False,
                     callback=_no_cuda_graph,
                     help="triton backend: launch each decode step's kernels one by one instead "
                          "of replaying a CUDA graph (slower; for debugging and comparisons; "
                          "sets LOCALMOE_CUDA_GRAPHS=0)."),
        click.option("--act-precision", type=click.Choice(["int8", "int16", "mixed"]),
                     default=None, expose_value=False, callback=_act_precision,
                     help="triton backend: activations of the quantized decode kernels. int8 "
                          "(default: llama.cpp's scheme, fastest), int16 (int8 plus the int8 "
                          "of its rounding error: closer to the float model, ~18% slower per "
                          "token on Qwen3-30B-A3B) or mixed (int16 except the routed experts' "
                          "inputs); sets LOCALMOE_ACT_PRECISION."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


#: the KV flags of :func:`model_options` (parameter name -> flag), in KVSpec.parse's order
KV_FLAGS = {"kv_cache": "--kv-cache", "kv_cache_k": "--kv-cache-k", "kv_cache_v": "--kv-cache-v"}


def check_model_name(ctx: click.Context, param: click.Parameter,
                     value: str | None) -> str | None:
    """Callback of a MODEL argument or ``-m/--model``: a blank name is a usage error (exit
    status 2; it never means the default model)."""
    if value is not None and not ctx.resilient_parsing and not value.strip():
        raise click.BadParameter("empty model name; give a store name (see `localmoe models`), "
                                 "a file path or an hf:OWNER/REPO/FILE reference",
                                 ctx=ctx, param=param)
    return value


def _check_backend(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Callback of ``--backend``: a name no backend is registered under (``foo``) is a usage
    error, exit status 2, ``Invalid value for '--backend': unknown backend 'foo'; choose one
    of: auto, ...``, before anything loads. A known backend that cannot run here (not
    installed, no GPU) stays the LocalMoEError (exit status 1) of the command's checks. A
    blank name is a usage error too; the value goes on as given (case is ignored there)."""
    if value is None or ctx.resilient_parsing or value.strip().lower() == "auto":
        return value
    if not value.strip():
        raise click.BadParameter("backend must not be empty; choose one of: auto, triton, "
                                 "llamacpp, torch", ctx=ctx, param=param)
    from localmoe.backends.registry import get_backend
    from localmoe.errors import BackendUnavailableError

    try:
        get_backend(value)
    except BackendUnavailableError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None
    return value


def _check_device(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Callback of ``--device``: a string that names no device (``tpu``, ``cuda:abc``) is a
    usage error, exit status 2, ``Invalid value for '--device': unknown device 'tpu'; ...``.
    A well-formed device that is not here (``cuda`` without a GPU, ``cuda:7``, ``cpu:1``)
    stays the LocalMoEError (exit status 1) of the command's checks before the load; the value
    goes on as given (``cpu:0`` is normalized there)."""
    if value is None or ctx.resilient_parsing:
        return value
    from localmoe.engine.options import device_syntax_error

    why = device_syntax_error(value)
    if why:
        raise click.BadParameter(why, ctx=ctx, param=param)
    return value


def _check_kv(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Callback of ``--kv-cache``, ``--kv-cache-k`` and ``--kv-cache-v`` (every command of
    :func:`model_options`): a value :meth:`KVSpec.parse` refuses (an unknown format, a bad
    option or group size) is a usage error, exit status 2, ``Invalid value for '--kv-cache':
    unknown KV cache format 'int7'; choose one of: ...``, before anything loads. The three are
    checked together once the last of them is processed (click fills ``ctx.params`` in
    processing order), since an override can make the rest of the string valid or not
    (``--kv-cache f16,sinks=4 --kv-cache-v int4`` is); the flag named is the one that fails on
    its own, else every KV flag given. What depends on the model or the backend (a group size
    over the head size, a format llama.cpp lacks) stays a LocalMoEError (exit status 1) of the
    load."""
    if ctx.resilient_parsing:
        return value
    values = {n: value if n == param.name else ctx.params.get(n) for n in KV_FLAGS}
    if any(n not in ctx.params for n in KV_FLAGS if n != param.name):
        return value   # not the last of the three: checked when that one comes
    if (values["kv_cache"], values["kv_cache_k"], values["kv_cache_v"]) == ("f16", None, None):
        return value   # the default (no import of the KV codecs, i.e. torch, for nothing)
    from localmoe.errors import KVCacheFormatError
    from localmoe.kv.spec import KVSpec

    try:
        KVSpec.parse(values["kv_cache"], values["kv_cache_k"], values["kv_cache_v"])
    except KVCacheFormatError as e:
        alone = {"kv_cache": lambda v: (v, None, None), "kv_cache_k": lambda v: ("f16", v, None),
                 "kv_cache_v": lambda v: ("f16", None, v)}
        given = [n for n in KV_FLAGS if values[n] is not None and
                 ctx.get_parameter_source(n) != click.core.ParameterSource.DEFAULT]
        # one side's format is checked alone before --kv-cache: a bad override makes the rest
        # of the string look wrong (`--kv-cache f16,sinks=4 --kv-cache-k f16:c`)
        for n in sorted(given, key=lambda n: n == "kv_cache"):
            try:
                KVSpec.parse(*alone[n](values[n]))
            except KVCacheFormatError as e1:
                raise click.BadParameter(str(e1), ctx=ctx, param_hint=f"'{KV_FLAGS[n]}'") from None
        hint = " / ".join(f"'{KV_FLAGS[n]}'" for n in given or KV_FLAGS)
        raise click.BadParameter(str(e), ctx=ctx, param_hint=hint) from None
    return value


def _act_precision(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:  # the triton runner reads it when it loads (the chat UI's too)
        os.environ["LOCALMOE_ACT_PRECISION"] = value


def _no_cuda_graph(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:  # the triton runner reads it when it loads (the chat UI's too)
        os.environ["LOCALMOE_CUDA_GRAPHS"] = "0"


def _set_threads(ctx: click.Context, param: click.Parameter, value: int | None) -> None:
    """Callback of ``-t/--threads``: sets ``$LOCALMOE_THREADS``. More threads than the CPUs
    this process may run on is allowed but says so on stderr (one ``warning:`` line): the
    OpenMP / ggml threads then share cores and decode gets many times slower."""
    if value is None or ctx.resilient_parsing:
        return
    from localmoe.cpu.threads import usable_cpus

    cpus = usable_cpus()
    if value > cpus:
        click.echo(f"warning: --threads {value} exceeds the {cpus} CPU{'s' if cpus != 1 else ''} "
                   f"of this machine; decode may be much slower", err=True)
    os.environ["LOCALMOE_THREADS"] = str(value)  # the backends read it when they load


def sampling_options(f):
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
        click.option("--seed", type=int, default=None,
                     help="Random seed (same seed, same output); -1: a fresh seed each run (as "
                          "llama.cpp). Default: a fresh seed."),
        click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=None,
                     help="Stop after this many generated tokens (default: until the end or the context is full)."),
        click.option("--stop", multiple=True, metavar="TEXT", help="Stop string (repeatable)."),
        click.option("--greedy", is_flag=True, help="Greedy decoding (same as --temperature 0)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


#: sampling parameters (the API's names, an error's ``param``) -> the command line's flags
SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                  "min_p": "--min-p", "repeat_penalty": "--repeat-penalty",
                  "repeat_last_n": "--repeat-last-n", "frequency_penalty": "--frequency-penalty",
                  "presence_penalty": "--presence-penalty", "seed": "--seed",
                  "max_tokens": "--max-tokens", "stop": "--stop"}


def sampling_kwargs(kw: dict) -> dict:
    keys = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
            "frequency_penalty", "presence_penalty", "seed", "max_tokens")
    out = {k: kw.pop(k) for k in keys if kw.get(k) is not None}
    for k in keys:
        kw.pop(k, None)
    if out.get("seed") == -1:   # llama.cpp's "random seed"
        del out["seed"]
    stop = kw.pop("stop", ())
    if stop:
        out["stop"] = tuple(stop)
    if kw.pop("greedy", False):
        if out.get("temperature", 0.0) != 0.0:
            raise click.UsageError(
                f"--greedy and --temperature {out['temperature']:g} contradict each other "
                "(--greedy means --temperature 0): give one of them")
        out["temperature"] = 0.0
    return out


def check_sampling(sampling: dict) -> None:
    """Refuse an out-of-range sampling flag before any model loads, as a usage error (exit
    status 2, as a malformed ``-n`` is) naming the flag: ``Invalid value for '--top-p':
    top_p must be <= 1.0, got 2``; an empty ``--stop ''`` too (the server refuses ``"stop":
    ""`` with a 400; vLLM would ignore it). Other errors (a ``--stop`` text that is not UTF-8,
    as the prompt's and ``--system``'s) stay ``LocalMoEError``s (exit status 1); a bad
    ``--json-schema`` is a usage error of its own (``localmoe.cli.generate._structured``)."""
    from localmoe.engine.options import make_sampling_params
    from localmoe.errors import InvalidRequestError

    if any(s == "" for s in sampling.get("stop", ())):  # as the server's 400 for "stop": ""
        raise click.BadParameter("a stop string must not be empty (it would match before any "
                                 "text is generated)", param_hint="'--stop'")
    try:
        make_sampling_params(None, **sampling)
    except InvalidRequestError as e:
        flag = SAMPLING_FLAGS.get(e.param or "")
        if flag is None or e.param == "stop":
            raise
        raise click.BadParameter(str(e), param_hint=f"'{flag}'") from None


def interruptible() -> None:
    """End of the start-up phase: Ctrl-C raises KeyboardInterrupt again, so generation stops
    cleanly (the group, :class:`localmoe.cli._Group`, prints ``interrupted``, status 130)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


class LoadIndicator:
    """A spinner on stderr while a model loads, on a terminal only (rich's status line; it
    leaves nothing behind when stopped). Off a terminal it does nothing.

    Args:
        label: the text beside the spinner, e.g. ``"loading smollm2"``.
    """

    def __init__(self, label: str):
        self.label = label
        self._live = None
        if stderr_is_terminal():
            from rich.console import Console
            from rich.live import Live
            from rich.spinner import Spinner

            self._spinner = Spinner("dots", text=label)
            # no stdout/stderr redirection: nothing but the spinner is drawn while it runs
            self._live = Live(self._spinner, console=Console(stderr=True, highlight=False),
                              transient=True, refresh_per_second=10, redirect_stdout=False,
                              redirect_stderr=False)
            self._live.start()

    def update(self, text: str) -> None:
        """Show ``label: text`` beside the spinner."""
        if self._live is not None:
            self._spinner.update(text=f"{self.label}: {text}")

    def print(self, line: str) -> None:
        """One line on stderr above the spinner (plain text, no markup)."""
        if self._live is not None:
            self._live.console.print(line, markup=False, highlight=False)
        else:
            click.echo(line, err=True)

    def stop(self) -> None:
        """Remove the spinner (again: nothing)."""
        if self._live is not None:
            self._live.stop()
            self._live = None


_ACTIVE: list[LoadIndicator] = []  # the load spinner running now (at most one)


def start_loading(model: str | None) -> LoadIndicator:
    """Start the load spinner for ``model`` (None: the default model) as soon as a command
    knows it will load one (imports and checks before the load take seconds too); the
    command group stops it before printing an error, :func:`load_llm` once loaded."""
    from localmoe.io.store.names import display_name

    stop_loading()
    spinner = LoadIndicator(f"loading {display_name(model)}")
    _ACTIVE.append(spinner)
    return spinner


def stop_loading() -> None:
    """Remove the load spinner, if one runs."""
    while _ACTIVE:
        _ACTIVE.pop().stop()


def auto_note(backend, model_format: str, kv_spec, chosen: str) -> None:
    """One ``note:`` line on stderr (above the load spinner when one runs) when auto passed
    over a backend for the KV format alone
    (:func:`localmoe.backends.registry.auto_kv_fallback`)."""
    from localmoe.backends.registry import auto_kv_fallback

    why = auto_kv_fallback(backend, model_format, kv_spec, chosen)
    if why:
        (_ACTIVE[0].print if _ACTIVE else lambda s: click.echo(s, err=True))(f"note: {why}")


def load_llm(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device, verbose=False,
             before_load=None):
    """The engine for the common options (``localmoe.LLM``; loading steps on stderr with
    ``verbose``); Ctrl-C raises KeyboardInterrupt again once it is loaded.

    On a terminal a spinner runs on stderr until the model is loaded (:class:`LoadIndicator`),
    except while a model not in the store yet is pulled (the pull draws its own bar).
    """
    from localmoe.errors import LocalMoEError
    from localmoe.io.store import ModelStore

    try:
        ModelStore().resolve(model, pull=False)
    except LocalMoEError:  # to be pulled (or missing: the load says so, after its own checks)
        stop_loading()  # the pull draws its own bar; the spinner comes back once it is done
    else:
        if not _ACTIVE:
            start_loading(model)

    def progress(frac: float, msg: str) -> None:
        if frac > 0 and not _ACTIVE:  # the model file is there now (pulled)
            start_loading(model)
        spinner = _ACTIVE[0] if _ACTIVE else None
        if verbose:
            if spinner is not None:
                spinner.print(f"[{frac * 100:3.0f}%] {msg}")
            else:
                click.echo(f"[{frac * 100:3.0f}%] {msg}", err=True)
        if spinner is not None:
            spinner.update(msg)

    def checked(llm) -> None:  # the command's checks, then why auto passed a backend over
        if before_load is not None:
            before_load(llm)
        from localmoe.engine.options import parse_kv_request

        auto_note(backend, llm.model_file.format,
                  parse_kv_request(kv_cache, kv_cache_k, kv_cache_v), llm.backend_name)

    try:
        from localmoe.api import LLM

        llm = LLM(model, backend=backend, n_ctx=n_ctx, kv_cache=kv_cache, kv_cache_k=kv_cache_k,
                  kv_cache_v=kv_cache_v, device=device, progress=progress,
                  before_load=checked)
    finally:
        stop_loading()
    interruptible()
    if verbose:
        st = llm.stats()
        threads = (f" | threads {st['n_threads']}" + (f" ({st['threads_reason']})"
                                                       if st.get("threads_reason") else "")
                   if st.get("n_threads") else "")
        click.echo(f"model {llm.model_name} | backend {llm.backend_reason} | context {llm.n_ctx} "
                   f"| kv {llm.kv_spec}{threads}", err=True)
    return llm
