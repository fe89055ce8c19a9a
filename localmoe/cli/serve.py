"""``localmoe serve``: the OpenAI-compatible HTTP server (:mod:`localmoe.serve.server`)."""

from __future__ import annotations

import click

from localmoe.cli.options import model_options
from localmoe.errors import LocalMoEError


@click.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--api-key", default=None, envvar="LOCALMOE_API_KEY",
              help="Require this bearer token (env LOCALMOE_API_KEY).")
def serve(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device, host, port, api_key):
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, ...)."""
    if api_key is not None:
        if not api_key.strip():   # a client cannot send a blank token: refuse, not lock out
            raise click.BadParameter(
                "is empty or blank; give a key, or leave --api-key and LOCALMOE_API_KEY unset "
                "for a server without authentication", param_hint="--api-key/LOCALMOE_API_KEY")
        api_key = api_key.strip()   # clients' tokens are compared without surrounding spaces
        if not (api_key.isascii() and api_key.isprintable()):  # what a header carries
            raise click.BadParameter(
                "must be printable ASCII: an HTTP Authorization header cannot carry other "
                "characters, so no client could send it", param_hint="--api-key/LOCALMOE_API_KEY")

    import localmoe.serve.server as server
    from localmoe.cli import sigterm_as_ctrl_c

    kwargs = dict(host=host, port=port, api_key=api_key, backend=backend, n_ctx=n_ctx,
                  kv_cache=kv_cache, kv_cache_k=kv_cache_k, kv_cache_v=kv_cache_v)
    if device is not None:
        kwargs["device"] = device
    try:
        # a SIGTERM before the port opens (the file checked or pulled, the imports) stops the
        # command as generate's does: `terminated` on stderr, status 143 (a pull removes its
        # temporaries); once serving, the server's own handlers drain and exit 0
        with sigterm_as_ctrl_c():
            server.run_server(model, **kwargs)
    except OSError as e:
        raise LocalMoEError(f"cannot serve on {host}:{port}: {e.strerror or e}; "
                            f"pick another --port or stop the other server") from e
