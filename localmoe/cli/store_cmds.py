"""``localmoe pull``, ``models`` and ``rm``: the model store from the command line."""

from __future__ import annotations

import json

import click

from localmoe.cli.options import OneLineUsageError, check_model_name


@click.command()
@click.argument("source", callback=check_model_name)
@click.option("--force", is_flag=True, help="Download again even if already stored.")
@click.option("--link", is_flag=True, help="For a local file: register it in place instead of copying.")
def pull(source, force, link):
    """Fetch a model into the store: NAME (smollm2, gemma3-270m), hf:OWNER/REPO/FILE.gguf or PATH."""
    from localmoe.cli import sigterm_as_ctrl_c
    from localmoe.io.store import ModelStore, format_size

    st = ModelStore()
    with sigterm_as_ctrl_c():  # SIGTERM removes the pull's temporaries as Ctrl-C does (143)
        m = st.pull(source, force=force, link=link)
    click.echo(f"{m.name}: {m.path} ({format_size(m.size)}, sha256 {m.sha256[:12] or '-'})")


@click.command("models")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def models_cmd(as_json):
    """List the models in the store (and the pullable short names); also `localmoe list`."""
    from localmoe.io.store import CATALOG, ModelStore, format_size

    st = ModelStore()
    items = st.list(include_missing=True)
    if as_json:
        click.echo(json.dumps([{"name": m.name, "path": str(m.path), "size": m.size,
                                "sha256": m.sha256, "source": m.source, "missing": m.missing,
                                "damaged": m.damaged, "changed": m.changed}
                               for m in items], indent=1))
        return
    click.echo(f"store: {st.models_dir}")
    if items:
        w = max(len(m.name) for m in items)
        for m in items:
            size = "missing" if m.missing else format_size(m.size)
            mark = "  DAMAGED" if m.damaged else "  CHANGED" if m.changed else ""
            click.echo(f"  {m.name:<{w}}  {size:>10}  {m.source}{mark}")
    else:
        click.echo("  (empty)")
    for m in items:
        if m.missing:
            click.echo(f"missing: the file of {m.name} is gone; {st.repair_hint(m)}")
        elif m.damaged:
            click.echo(f"damaged: {m.name} is {m.size:,} bytes on disk, not the {m.recorded_size:,} "
                       f"it was pulled with; {st.repair_hint(m)}")
        elif m.changed:
            click.echo(f"changed: the linked file of {m.name} is {m.size:,} bytes, not the "
                       f"{m.recorded_size:,} it was linked with; `localmoe pull {m.name}` checks "
                       f"it and links it again, or `localmoe rm {m.name}`")
    missing = [e for n, e in CATALOG.items() if st.get(n, include_missing=True) is None]
    if missing:
        click.echo("pullable: " + ", ".join(f"{e.name} ({e.description})" for e in missing))


@click.command()
@click.argument("name")
def rm(name):
    """Delete a model from the store."""
    from localmoe.io.store import ModelStore, format_size

    if not name.strip():   # a malformed argument: a usage error, as `generate ""` is
        raise OneLineUsageError("empty model name; give the name of a stored model (see "
                                "`localmoe models`)")
    m = ModelStore().remove(name)
    if m.shared_with:
        note = f" (files kept: also used by {', '.join(m.shared_with)})"
    elif m.missing:
        note = " (its files were gone already)"
    elif m.linked:
        note = ""
    elif m.kept_outside:  # a hand-edited entry: its files outside the store are not its own
        note = (f" ({format_size(m.freed)} freed; left in place outside the store: "
                f"{', '.join(str(f) for f in m.kept_outside)})")
    else:
        note = f" ({format_size(m.freed)} freed)"
    click.echo(f"removed {m.name}{note}")
