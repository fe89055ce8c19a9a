"""``localmoe info`` (a model's facts, :func:`model_info`) and ``localmoe backends``."""

from __future__ import annotations

import json
from typing import Any

import click

from localmoe.cli.options import KV_INFO_FORMATS, check_model_name
from localmoe.errors import LocalMoEError


def model_info(model_file, model: str | None = None) -> dict[str, Any]:
    """Facts about a model for ``localmoe info`` (pure; used by tests).

    Args:
        model_file: the opened model.
        model: the model as the user named it (a path or store name); None: its path.

    Returns a dict with: model (the name ``generate --json`` and ``serve`` report it by:
    :func:`localmoe.io.store.display_name` of ``model``), name (the file's own,
    ``general.name`` of a GGUF), path, format, architecture, params_total, params_active,
    n_experts, top_k, n_shared_experts, d_ff_expert, n_layers, d_model, n_heads, n_kv_heads,
    head_dim, context (training context in tokens), n_ctx_default (the context a run gets
    without --ctx-size, tokens), chat_template (bool), chat_template_error (why a template
    does not compile, else None: such a model runs plain completions only), quant_mix ({qtype: {"tensors": n,
    "bytes": b}}), kv_bytes_per_token ({format: bytes per token or None}, formats of
    :data:`KV_INFO_FORMATS`: ``"int4"`` is the default per-channel keys, ``"int4:t"`` per-token
    keys), kv_key_grouping ({format: "channel" | "token" | None for float/fp4 keys}).
    """
    from localmoe.text.chat_template import ChatTemplate

    from localmoe.io.store import display_name
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
        "model": display_name(model if model is not None else model_file.path),
        "name": model_file.name, "path": str(model_file.path), "format": model_file.format,
        "architecture": spec.arch, "params_total": total, "params_active": active,
        "n_experts": spec.n_experts, "top_k": spec.top_k, "n_shared_experts": spec.n_shared_experts,
        "d_ff_expert": spec.d_ff_expert, "n_layers": spec.n_layers, "d_model": spec.d_model,
        "n_heads": spec.n_heads, "n_kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size, "context": spec.n_ctx_train, "n_ctx_default": n_ctx_default,
        "sliding_window": spec.sliding_window,
        "chat_template": bool(model_file.chat_template),
        "chat_template_error": ChatTemplate.compile_error(model_file), "quant_mix": mix,
        "kv_bytes_per_token": kv, "kv_key_grouping": grouping,
    }


def _fmt_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


@click.command()
@click.argument("model", required=False, callback=check_model_name)
@click.option("-m", "--model", "model_opt", default=None, metavar="MODEL",
              callback=check_model_name,
              help="The model, as for generate (the same as the MODEL argument).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def info(model, model_opt, as_json):
    """Show a model's architecture, parameters, experts, quant mix, context, template and the
    KV cache bytes per token of every format (MODEL: a path, store name, short name or hf:
    reference; also as -m MODEL)."""
    from localmoe.io.loader import open_model
    from localmoe.io.store import ModelStore, format_size

    if model is not None and model_opt is not None and model != model_opt:
        raise click.UsageError(f"two models given ({model!r} and -m {model_opt!r}); give one")
    model = model if model is not None else model_opt
    if model is None:
        raise click.UsageError("give the model: localmoe info MODEL (or -m MODEL)")

    mf = open_model(ModelStore().resolve(model))
    d = model_info(mf, model)
    if as_json:
        click.echo(json.dumps(d, indent=1))
        return
    moe = (f"{d['n_experts']} experts, top-{d['top_k']}, d_ff_expert {d['d_ff_expert']}"
           + (f", {d['n_shared_experts']} shared" if d["n_shared_experts"] else "")
           if d["n_experts"] else "none (dense)")
    rows = [("model", f"{d['model']}  ({d['path']})")]
    if d["name"] != d["model"]:  # general.name: no command takes or reports it
        rows.append(("name in file", d["name"]))
    rows += [
        ("format", d["format"]),
        ("architecture", d["architecture"]),
        ("parameters", f"{_fmt_count(d['params_total'])} total, {_fmt_count(d['params_active'])} active per token"),
        ("experts", moe),
        ("shape", f"{d['n_layers']} layers, d_model {d['d_model']}, {d['n_heads']} q / "
                  f"{d['n_kv_heads']} kv heads, head_dim {d['head_dim']}, vocab {d['vocab_size']}"),
        ("context", f"{d['context']} tokens" + (f" (sliding window {d['sliding_window']})"
                                                 if d["sliding_window"] else "")),
        ("chat template", ("no" if not d["chat_template"] else "yes" if not d["chat_template_error"]
                           else f"does not compile ({d['chat_template_error']}): plain "
                                f"completions only")),
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
    sizes = [n_def] if n_full == n_def else [n_def, n_full]   # one column when they are equal
    click.echo(f"  {'format':<7} {'keys':<11} {'bytes/token':>11}"
               + "".join(f"  {f'{n} tok':>10}" for n in sizes))
    for fmt, b in d["kv_bytes_per_token"].items():
        g = d["kv_key_grouping"].get(fmt)
        keys = {"channel": "per channel", "token": "per token"}.get(g, "-")
        if b is None:
            click.echo(f"  {fmt:<7} {keys:<11} (not available in this build)")
        else:
            click.echo(f"  {fmt:<7} {keys:<11} {b:>11,.0f}"
                       + "".join(f"  {format_size(b * n):>10}" for n in sizes))
    if len(sizes) == 1:
        click.echo(f"  ({n_def}: the default context, which is also the training context)")
    else:
        click.echo(f"  ({n_def}: the default context, allocated without --ctx-size; {n_full}: the "
                   f"training context)")


@click.command()
def backends():
    """List backends, whether each can run here, and which one `auto` picks for GGUF."""
    from localmoe.backends.registry import list_backends, select_backend

    rows = list_backends()
    w = max((len(n) for n, _, _ in rows), default=4)
    for name, reason, desc in rows:
        status = "available" if reason is None else f"unavailable: {reason}"
        click.echo(f"{name:<{w}}  {status}")
        click.echo(f"{'':<{w}}  {desc}")
    for fmt in ("gguf", "safetensors"):
        try:
            be, why = select_backend("auto", fmt)
            # why reads "torch (auto; skipped ...)": the backend, then what auto passed over
            skipped = why.partition("; skipped ")[2]
            skipped = skipped[:-1] if skipped.endswith(")") else skipped   # the wrapper's ")"
            click.echo(f"auto for {fmt}: {be.name}" + (f" (skipped {skipped})" if skipped else ""))
        except LocalMoEError as e:
            click.echo(f"auto for {fmt}: none ({e})")
