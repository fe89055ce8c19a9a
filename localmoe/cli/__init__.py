"""``localmoe`` command line (click).

The CLI is thin: it parses flags, resolves the model through the store and calls the engine,
the TUI or the server. Heavy modules (torch, the engine, backends) are imported inside the
commands so ``localmoe --help`` stays fast. Errors a user can cause (``LocalMoEError``) print one
line ``error: ...`` on stderr and exit with status 1; Ctrl-C stops generation cleanly and exits
with status 130 (SIGTERM does the same for ``generate``, ``pull`` and ``serve`` before its
port opens, status 143:
:func:`sigterm_as_ctrl_c`); usage errors print one line ``error: ... (see 'localmoe CMD
--help')`` and exit with status 2 (click's convention).

One module per command family: :mod:`.generate`, :mod:`.chat`, :mod:`.serve`,
:mod:`.store_cmds` (pull, models, rm), :mod:`.info` (info, backends), :mod:`.bench`; the
options and helpers they share are in :mod:`.options`. A command's module is imported when the
command is looked up (``localmoe generate`` imports only :mod:`.generate`), so importing this
package stays as cheap as one module.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import signal
import sys
import threading
from typing import Any, Iterator

import click

from localmoe import __version__
from localmoe.errors import LocalMoEError
from localmoe.io.console import note, stderr_is_terminal

__all__ = ["cli", "main", "model_info"]

#: command name -> (module of localmoe.cli, attribute): imported on first lookup
COMMANDS = {
    "backends": ("info", "backends"),
    "bench": ("bench", "bench"),
    "chat": ("chat", "chat"),
    "generate": ("generate", "generate"),
    "info": ("info", "info"),
    "models": ("store_cmds", "models_cmd"),
    "pull": ("store_cmds", "pull"),
    "rm": ("store_cmds", "rm"),
    "serve": ("serve", "serve"),
}


#: other names a user of Ollama types: accepted, not listed in ``--help``
ALIASES = {"list": "models", "ls": "models", "show": "info"}


def __getattr__(name: str) -> Any:  # `from localmoe.cli import model_info` (tests, tools)
    if name == "model_info":
        from localmoe.cli.info import model_info

        return model_info
    raise AttributeError(name)


class _Group(click.Group):
    """Click group that turns user errors into one line and Ctrl-C into exit status 130, and
    imports a command's module only when the command is looked up."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        cmd_name = ALIASES.get(cmd_name, cmd_name)
        if cmd_name not in COMMANDS:
            return None
        module, attr = COMMANDS[cmd_name]
        return getattr(importlib.import_module(f"localmoe.cli.{module}"), attr)

    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:  # `localmoe --bogus`
            _one_line_usage(e)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            try:
                return super().invoke(ctx)
            finally:
                _stop_spinner()  # the load spinner goes before an error line is printed
        except click.UsageError as e:  # a command's flags or arguments, an unknown command
            sub = ctx.invoked_subcommand
            _one_line_usage(e, f"{ctx.command_path} {sub}" if sub else ctx.command_path)
            raise
        except LocalMoEError as e:
            click.echo(f"error: {e}{_flag_of(e)}", err=True)
            ctx.exit(1)
        except KeyboardInterrupt:
            word, status = _interrupted()
            click.echo(f"\n{word}", err=True)
            ctx.exit(status)
        except BrokenPipeError:  # `localmoe generate ... | head`
            try:
                sys.stdout = open(os.devnull, "w")
            except OSError:
                pass
            ctx.exit(0)


def _flag_of(e: LocalMoEError) -> str:
    """`` (--top-p)`` for an error about a sampling parameter the command line sets by a flag
    (the message uses the API's name, ``top_p``), else ``""``."""
    param = getattr(e, "param", None)
    if not param:
        return ""
    from localmoe.cli.options import SAMPLING_FLAGS

    flag = SAMPLING_FLAGS.get(param)
    return f" ({flag})" if flag else ""


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


def _one_line_usage(e: click.UsageError, fallback: str = "localmoe") -> None:
    """Make click print usage error ``e`` as one line, ``error: MESSAGE (see 'localmoe CMD
    --help')``, instead of its usage block, hint and blank line; the exit status stays 2.
    A bare group or command shown its help for want of arguments keeps the help.
    ``fallback``: the command path to name when click gave the error no context (an option
    missing its value)."""
    if isinstance(e, click.exceptions.NoArgsIsHelpError):
        return

    def show(file: Any = None) -> None:
        path = e.ctx.command_path if e.ctx is not None else fallback
        # err=True, not file=sys.stderr: with stderr closed that is None, which means stdout
        click.echo(f"error: {e.format_message()} (see '{path} --help')", file=file,
                   err=file is None)

    e.show = show  # type: ignore[method-assign]


def _stop_spinner() -> None:
    """Stop the load spinner of :mod:`.options` if that module is in use."""
    opts = sys.modules.get("localmoe.cli.options")
    if opts is not None:
        opts.stop_loading()


#: what Ctrl-C in the start-up phase writes on stdout before it exits (``generate --json``:
#: one JSON object saying the run was cancelled); empty: nothing
_INTERRUPTED_STDOUT: list[str] = []


def on_start_up_interrupt(text: str | None) -> None:
    """Have a Ctrl-C of the start-up phase (:func:`_stop_now`) write ``text`` on stdout before
    it exits (None: nothing), as a script reading ``generate --json`` needs one JSON object
    whenever the command ends."""
    _INTERRUPTED_STDOUT[:] = [text] if text else []


#: set when a SIGTERM was turned into a Ctrl-C (:func:`sigterm_as_ctrl_c`)
_TERMINATED = [False]


def _interrupted() -> tuple[str, int]:
    """The line and exit status of a command stopped by Ctrl-C (``interrupted``, 130) or by
    a SIGTERM that :func:`sigterm_as_ctrl_c` handled as one (``terminated``, 143 = 128 + 15)."""
    terminated, _TERMINATED[0] = _TERMINATED[0], False
    return ("terminated", 143) if terminated else ("interrupted", 130)


def _on_sigterm(signum, frame) -> None:
    """SIGTERM handler of :func:`sigterm_as_ctrl_c`: do what Ctrl-C would do right now (the
    SIGINT handler installed at this moment: the start-up phase's :func:`_stop_now`, the
    pull's, or Python's KeyboardInterrupt), remembering it was a SIGTERM for the status."""
    _TERMINATED[0] = True
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:  # SIGINT ignored or not Python's: stop as Ctrl-C does when it is not
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """Within the block (a command's work, on the main thread), SIGTERM (``timeout``, ``kill``)
    stops the command as Ctrl-C does (``generate`` prints what was generated, ``pull`` removes
    its temporaries) and it exits with status 143 instead of 130. A SIGTERM handler set by
    someone else, or SIGTERM ignored, is left as it is; the previous handler is restored
    afterwards. Off the main thread: nothing (signals are the main thread's)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    prev = signal.getsignal(signal.SIGTERM)
    if prev is not signal.SIG_DFL:  # ignored, or a handler of its own (serve's drain, a host's)
        yield
        return
    _TERMINATED[0] = False
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, prev)


def _stop_now(signum, frame) -> None:
    """SIGINT handler of the start-up phase: print ``interrupted`` and exit at once (130; after
    a SIGTERM handled as Ctrl-C, ``terminated`` and 143). On a terminal the load spinner's line
    is cleared and the cursor it hid is shown again. What :func:`on_start_up_interrupt` set is
    written on stdout first."""
    try:
        if _INTERRUPTED_STDOUT:
            text = _INTERRUPTED_STDOUT[0]
            try:
                sys.stdout.write(text)
                sys.stdout.flush()
            except (RuntimeError, AttributeError, ValueError):  # interrupted mid-write
                os.write(1, text.encode("utf-8"))
    except OSError:  # stdout closed or broken: the exit status still says it
        pass
    word, status = _interrupted()
    try:
        note(("\r\x1b[2K\x1b[?25h" if stderr_is_terminal() else "\n") + word)
    finally:
        os._exit(status)


#: errors of writing the output that a user can cause (a full disk, a closed or broken file)
_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF}


def _output_failed(e: OSError) -> None:
    """One ``error:`` line for output that cannot be written (``> /dev/full``), exit status 1;
    stdout is pointed at /dev/null so the interpreter's final flush does not fail again."""
    try:
        sys.stdout = open(os.devnull, "w")
    except OSError:
        pass
    note(f"error: cannot write the output: {e.strerror or e}")
    sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``localmoe``).

    Until a command starts its interruptible work (generation, the chat UI, the server's own
    handlers), Ctrl-C exits at once with status 130 (:func:`_stop_now`): nothing is lost yet,
    and a KeyboardInterrupt raised while torch, numpy, triton or llama.cpp import can leave a
    module half initialised or abort the process from C++.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _stop_now)
    try:
        cli.main(args=argv, prog_name="localmoe")
    except OSError as e:
        if e.errno not in _OUTPUT_ERRNOS:
            raise
        _output_failed(e)
    except SystemExit as e:  # click ends every command this way
        _exit_fast(e.code)
        raise


#: modules whose interpreter teardown is slow: after `import torch` alone the interpreter takes
#: ~0.45 s to finalize (0.35 s tearing modules down, 0.1 s in C++ static destructors), 1-2 s on
#: a busy 2-core machine, all after the answer was printed
_SLOW_TEARDOWN = ("torch", "llama_cpp", "triton")


def _exit_fast(code: Any) -> None:
    """End the process once a command is done without the interpreter's teardown, where a
    heavy module was imported (:data:`_SLOW_TEARDOWN`): the ``atexit`` handlers run, stdout
    and stderr are flushed, then ``os._exit(status)``. Nothing is lost: every file the commands
    write is closed (and the store's fsynced) before they return. Returns (and leaves the exit
    to the caller) when no such module is loaded or this is not the main thread."""
    if threading.current_thread() is not threading.main_thread() or \
            not any(m in sys.modules for m in _SLOW_TEARDOWN):
        return
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): printed, status 1
        status = 1
        note(str(code))
    import atexit

    atexit._run_exitfuncs()
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except BrokenPipeError:  # `... | head`: the reader is gone; nothing to report
        pass
    except OSError as e:
        if e.errno not in _OUTPUT_ERRNOS:
            raise
        _output_failed(e)  # sys.exit(1) -> through here again without the failing stdout
    except ValueError:  # stdout closed
        pass
    try:
        sys.stderr.flush()
    except (OSError, AttributeError, ValueError):
        pass
    os._exit(status)
