"""``localmoe generate``: one answer (or plain completion) streamed to stdout."""

from __future__ import annotations

import json
import os
import sys

import click

from localmoe.cli import options, routing
from localmoe.cli.options import OneLineUsageError, model_options, sampling_kwargs, sampling_options
from localmoe.errors import LocalMoEError, require_utf8


@click.command()
@click.argument("prompt", required=False)
@model_options
@sampling_options
@click.option("--raw", is_flag=True, help="Plain-text completion: do not apply the chat template.")
@click.option("--system", default=None, metavar="TEXT",
              help="System message. A model without a chat template gets a plain "
                   "System:/User:/Assistant: transcript (with a warning); ignored with --raw.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, tokens, finish reason, timings) instead of streaming.")
@click.option("--json-schema", "json_schema", default=None, metavar="FILE",
              help="Constrain the answer to JSON valid under the JSON Schema in FILE (or "
                   "given inline as JSON text starting with '{').")
@click.option("--json-object", "json_object", is_flag=True,
              help="Constrain the answer to one JSON object (JSON mode).")
@click.option("-v", "--verbose", is_flag=True, help="Print loading steps and timings on stderr.")
@routing.record_routing_option
def generate(prompt, model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device, raw,
             system, as_json, json_schema, json_object, verbose, record_routing, **kw):
    """Generate a reply to PROMPT (or stdin) and stream it to stdout.

    The model's chat template is applied when it has one (as `ollama run` does); --raw sends
    the text as is for plain completion. --json-schema / --json-object constrain the answer
    (docs/STRUCTURED_OUTPUT.md); --json is the output format of this command.
    """
    if sys.stdout is None:  # `localmoe generate ... >&-`: refuse before the weights load
        raise LocalMoEError("standard output is closed: there is nowhere to write the answer")
    # --json: Ctrl-C at any moment prints one JSON object with finish_reason "cancelled" (while
    # the model loads, from the start-up phase's SIGINT handler, localmoe.cli._stop_now);
    # SIGTERM (`timeout 5 localmoe generate ...`) does what Ctrl-C does, exit status 143
    from localmoe.cli import on_start_up_interrupt, sigterm_as_ctrl_c

    if as_json:
        on_start_up_interrupt(_cancelled(None, model) + "\n")
    try:
        with sigterm_as_ctrl_c():
            return _generate(prompt, model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v,
                             device, raw, system, as_json, json_schema, json_object, verbose,
                             record_routing, **kw)
    except KeyboardInterrupt as e:
        if as_json and not getattr(e, "json_printed", False):  # _stream prints the text so far
            click.echo(_cancelled(None, model))
        raise
    finally:
        on_start_up_interrupt(None)


def _generate(prompt, model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device, raw,
              system, as_json, json_schema, json_object, verbose, record_routing, **kw):
    """The work of :func:`generate` (its arguments)."""
    piped = prompt in (None, "-") and sys.stdin is not None and not sys.stdin.isatty()
    given = prompt not in (None, "-") and prompt.strip()
    if given and _stdin_waiting():  # `echo hi | localmoe generate x`: the pipe goes unread
        click.echo("note: the piped stdin was ignored because a PROMPT argument was given "
                   "(give '-' as the PROMPT to read the prompt from stdin)", err=True)
    if piped or given:  # a prompt, not typed in
        options.start_loading(model)  # on a terminal: a spinner from now (imports take seconds)
    sampling = sampling_kwargs(kw)
    sampling.update(_structured(json_schema, json_object))
    from localmoe.engine.options import make_sampling_params

    options.check_sampling(sampling)  # out-of-range values fail before the weights load
    if record_routing:  # an unwritable file or a backend that cannot record: before any work
        backend = routing.check_request(record_routing, backend)
    prompt = _read_prompt(prompt)
    if system is not None:
        require_utf8(system, "--system", "system")
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
        if n == llm.n_ctx:   # it would end at once with nothing printed
            raise ContextOverflowError.fills_context(
                n, llm.n_ctx, hint="shorten the prompt or raise --ctx-size")
        if record_routing:
            routing.check_model(llm)

    llm = options.load_llm(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device,
                           verbose, before_load=fits)
    rec = result = None
    try:
        if record_routing:
            rec = routing.recorder(llm)
            rec.__enter__()
        if plain(llm):
            if not raw:   # a base model: say why the answer reads as a continuation
                click.echo(f"note: {llm.model_name} has no chat template; the prompt is "
                           f"completed as plain text (as with --raw)", err=True)
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
        result = _stream(llm, events, as_json)
        cut = result is not None and result.finish_reason == "length"
        # cut because the context is full rather than at --max-tokens: said on stderr (--json
        # has it in finish_reason and the token counts); stdout keeps what was generated
        full = cut and result.prompt_tokens + result.completion_tokens >= llm.n_ctx
        schema = json_schema is not None or json_object
        if full and (schema or not as_json):
            click.echo(f"note: the context ({llm.n_ctx} tokens) is full: the answer was cut "
                       f"after {result.completion_tokens} token"
                       f"{'s' if result.completion_tokens != 1 else ''}"
                       + ("; the JSON is incomplete" if schema else "")
                       + "; a larger -c/--ctx-size leaves more room", err=True)
        elif cut and schema:
            n = sampling.get("max_tokens") or result.completion_tokens
            click.echo(f"warning: the answer was cut at --max-tokens ({n}); the JSON is "
                       f"incomplete", err=True)
        if rec is not None:
            _write_routing(llm, rec, record_routing, result)
            rec = None
        _report(llm, result, as_json, verbose)
    finally:
        if rec is not None:  # interrupted: keep what was routed so far
            _write_routing(llm, rec, record_routing, result)
        llm.close()


def _write_routing(llm, rec, path: str, result) -> None:
    rec.__exit__(None, None, None)
    if rec.steps:
        trace = rec.take_trace("generate", "generate", result.text if result is not None else "")
        routing.write(path, llm, rec, [trace], "generate")


def _structured(json_schema: str | None, json_object: bool) -> dict:
    """The sampling options of --json-schema FILE / --json-object, checked before any model
    loads (the grammar engine compiles a schema without the tokenizer). A schema that is not
    JSON, not a JSON Schema or one the engine does not support, inline or in FILE, is a usage
    error (exit status 2, ``Invalid value for '--json-schema': ...``) as a malformed flag is;
    a FILE that cannot be read (or is not UTF-8) stays a LocalMoEError (exit status 1)."""
    if json_schema is not None and json_object:
        raise OneLineUsageError("give --json-schema or --json-object, not both")
    if json_object:
        return {"json_object": True}
    if json_schema is None:
        return {}
    text = json_schema
    if not json_schema.strip():
        raise click.BadParameter("is empty: give a JSON schema inline or a file name",
                                 param_hint="'--json-schema'")
    try:  # inline JSON, else a file name
        inline = json.loads(json_schema)
    except ValueError:
        is_json = False
    else:
        is_json = True
        if not isinstance(inline, (dict, bool)):  # `[1,2]` is JSON, not a file name
            raise click.BadParameter(f"the schema must be a JSON object, not "
                                     f"{json_schema.strip()[:40]}", param_hint="'--json-schema'")
    if not is_json and not json_schema.lstrip().startswith("{"):
        try:
            with open(json_schema, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise LocalMoEError(f"cannot read the JSON schema {json_schema}: "
                                f"{e.strerror or e}") from None
        except UnicodeDecodeError:
            raise LocalMoEError(f"the JSON schema {json_schema} is not UTF-8 text") from None
    from localmoe.errors import InvalidRequestError
    from localmoe.text.grammar import validate_schema

    what = f"the schema in {json_schema}" if text is not json_schema else "the schema"
    try:
        return {"json_schema": validate_schema(text, True, what)}
    except InvalidRequestError as e:
        if e.param != what:   # not the schema's fault (llguidance missing): exit status 1
            raise
        msg = str(e)
        if msg.startswith(f"{what}: "):   # "the schema: unknown type ..." -> "unknown type ..."
            msg = msg[len(what) + 2:] + ("" if text is json_schema else f" (in {json_schema})")
        raise click.BadParameter(msg, param_hint="'--json-schema'") from None


#: characters read from stdin at most (no context of 1 M tokens holds more)
_STDIN_MAX = 256 << 20


def _stdin_waiting() -> bool:
    """Whether a piped or redirected stdin holds data: unread bytes of a file, or bytes
    already in a pipe. Found without reading any (a ``while read`` loop around the command
    keeps its input) or waiting: a terminal, ``/dev/null``, an empty or closed pipe and a pipe
    whose writer has written nothing yet count as none."""
    try:
        import fcntl
        import stat
        import struct
        import termios

        if sys.stdin is None or sys.stdin.isatty():
            return False
        fd = sys.stdin.fileno()
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            return st.st_size > os.lseek(fd, 0, os.SEEK_CUR)
        if not (stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
            return False
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0] > 0
    except (ImportError, AttributeError, ValueError, OSError):  # no fd (an in-memory stdin)
        return False


def _read_prompt(prompt: str | None) -> str:
    """The prompt argument, or stdin for none or ``-`` (without its trailing newline).

    Raises:
        OneLineUsageError: no prompt (nothing piped either) or an empty one.
        InvalidRequestError: a prompt UTF-8 cannot encode (undecodable input bytes).
    """
    if prompt is None or prompt == "-":
        if sys.stdin is None or (sys.stdin.isatty() and prompt is None):
            raise OneLineUsageError("no prompt; give a PROMPT argument or pipe the prompt on stdin")
        prompt = sys.stdin.read(_STDIN_MAX + 1)
        if len(prompt) > _STDIN_MAX:  # `< /dev/zero` must not fill the memory
            raise OneLineUsageError(f"the prompt on stdin is over {_STDIN_MAX >> 20} Mi characters, "
                                    f"more than any context holds (docs/LIMITS.md)")
        prompt = prompt.rstrip("\r\n")  # `echo hi |` adds a newline
    if not prompt.strip():
        raise OneLineUsageError("the prompt is empty; give a PROMPT argument or pipe the prompt on "
                                "stdin")
    require_utf8(prompt, "the prompt", "prompt")
    return prompt


def _header(llm) -> dict:
    return {"model": llm.model_name, "backend": llm.backend_name, "n_ctx": llm.n_ctx,
            "kv_cache": str(llm.kv_spec)}


def _cancelled(llm, model: str | None, text: str = "") -> str:
    """The ``--json`` object of a run stopped by Ctrl-C: the header (before ``llm`` is loaded,
    None: the model's name as given and null for what is not known yet), ``text`` generated
    so far and ``finish_reason`` "cancelled"."""
    if llm is not None:
        head = _header(llm)
    else:
        from localmoe.io.store.names import display_name

        head = {"model": display_name(model), "backend": None, "n_ctx": None, "kv_cache": None}
    d = {**head, "text": text, "finish_reason": "cancelled"}
    out = json.dumps(d, ensure_ascii=False)
    try:
        out.encode("utf-8")
    except UnicodeEncodeError:  # a model name of undecodable argv bytes: JSON escapes
        out = json.dumps(d)
    return out


def _stream(llm, events, as_json: bool):
    """Write the deltas of ``events`` to stdout as they come (collect them with ``as_json``)
    and return the final result. Ctrl-C with ``as_json`` prints what was generated as one JSON
    object (``finish_reason`` "cancelled") before the KeyboardInterrupt goes on.

    On a terminal the model's control characters (ESC sequences, BEL, ...) are shown, not
    obeyed (:mod:`localmoe.text.terminal`); piped output keeps the text exactly."""
    result = None
    out = sys.stdout
    wrote_nl = True
    parts: list[str] = []
    shown = None
    if not as_json:
        try:
            if out.isatty():
                from localmoe.text.terminal import TerminalText

                shown = TerminalText()
        except (AttributeError, ValueError, OSError):
            pass
    try:
        for ev in events:
            if ev.done:
                result = ev.result
            elif not as_json:
                out.write(ev.delta if shown is None else shown.feed(ev.delta))
                out.flush()
                wrote_nl = ev.delta.endswith("\n")
            else:
                parts.append(ev.delta)
    except KeyboardInterrupt as e:
        if as_json:  # keep what was generated: one JSON object, then exit 130
            click.echo(_cancelled(llm, None, "".join(parts)))
            e.json_printed = True
        raise
    finally:
        close = getattr(events, "close", None)
        if close:
            close()
        if shown is not None:
            out.write(shown.flush())
        if not as_json and not wrote_nl:
            out.write("\n")
            out.flush()
    return result


def _report(llm, result, as_json: bool, verbose: bool) -> None:
    """The JSON object (``--json``) or, with ``--verbose``, the timings line on stderr."""
    if as_json:
        d = _header(llm)
        d.update(result.to_dict())
        click.echo(json.dumps(d, ensure_ascii=False))
    elif verbose and result is not None:
        t = result.timings
        click.echo(f"[{result.finish_reason}] prompt {result.prompt_tokens} tok "
                   f"({t.prefill_tok_s:.1f} tok/s) | {result.completion_tokens} tok, TTFT "
                   f"{t.ttft_ms:.0f} ms, TPOT {t.tpot_ms:.1f} ms, {t.decode_tok_s:.1f} tok/s",
                   err=True)
