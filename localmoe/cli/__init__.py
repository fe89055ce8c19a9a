"""``localmoe`` command line (click).

The CLI is thin: it parses flags, resolves the model through the store and calls the engine,
the TUI or the server. Heavy modules (torch, the engine, backends) are imported inside the
commands so ``localmoe --help`` stays fast. Errors a user can cause (``LocalMoEError``) print one
line ``error: ...`` on stderr and exit with status 1; Ctrl-C stops generation cleanly and exits
with status 130; usage errors exit with status 2 (click's convention).

One module per command family: :mod:`.generate`, :mod:`.chat`, :mod:`.serve`,
:mod:`.store_cmds` (pull, models, rm), :mod:`.info` (info, backends), :mod:`.bench`; the
options and helpers they share are in :mod:`.options`. A command's module is imported when the
command is looked up (``localmoe generate`` imports only :mod:`.generate`), so importing this
package stays as cheap as one module.
"""

from __future__ import annotations

import errno
import importlib
import os
import signal
import sys
import threading
from typing import Any

import click

from localmoe import __version__
from localmoe.errors import LocalMoEError

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
        if cmd_name not in COMMANDS:
            return None
        module, attr = COMMANDS[cmd_name]
        return getattr(importlib.import_module(f"localmoe.cli.{module}"), attr)

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


def _stop_now(signum, frame) -> None:
    """SIGINT handler of the start-up phase: print ``interrupted`` and exit at once (130)."""
    try:
        sys.stderr.write("\ninterrupted\n")
        sys.stderr.flush()
    finally:
        os._exit(130)


#: errors of writing the output that a user can cause (a full disk, a closed or broken file)
_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF}


def _output_failed(e: OSError) -> None:
    """One ``error:`` line for output that cannot be written (``> /dev/full``), exit status 1;
    stdout is pointed at /dev/null so the interpreter's final flush does not fail again."""
    try:
        sys.stdout = open(os.devnull, "w")
    except OSError:
        pass
    try:
        sys.stderr.write(f"error: cannot write the output: {e.strerror or e}\n")
        sys.stderr.flush()
    except (OSError, AttributeError, ValueError):
        pass
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
