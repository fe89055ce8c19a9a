"""``localmoe bench``: prefill and decode speed of one model (greedy, fixed lengths)."""

from __future__ import annotations

import json
import os

import click

from localmoe.cli import options, routing
from localmoe.cli.options import model_options
from localmoe.errors import LocalMoEError


def _check_writable(path: str) -> None:
    """Raise LocalMoEError unless ``path`` can be written: an existing file is opened for
    writing without truncating it and given an empty write (a read-only or immutable file,
    or one that opens but takes no data such as /proc/version as root, fails here, not after
    the benchmark; a regular file is left as it was), a new one is created and removed
    again."""
    if os.path.lexists(path):
        try:
            with open(path, "r+b", buffering=0) as f:
                f.write(b"")   # no bytes: a file that refuses writes says so, nothing changes
        except OSError as e:
            raise LocalMoEError(f"cannot write {path}: {e.strerror or e}") from None
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise LocalMoEError(f"cannot write {path}: {parent} is not a writable folder")
    try:   # the folder's mode can say yes where creating fails (/proc, a read-only mount, root)
        with open(path, "xb"):
            pass
        os.remove(path)
    except OSError as e:
        raise LocalMoEError(f"cannot write {path}: {e.strerror or e}") from None


@click.command()
@model_options
@click.option("-p", "--prompt-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("-n", "--gen-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("-r", "--repeat", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True),
              default=None, metavar="FILE",
              help="Also write the results to this JSON file ('-': the JSON on stdout, the "
                   "table on stderr).")
@routing.record_routing_option
def bench(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device, prompt_tokens,
          gen_tokens, repeat, json_out, record_routing):
    """Measure prefill and decode speed (greedy, fixed lengths, median of repeats).

    With --record-routing, one more run of the same prompt after the timed ones is recorded
    (the timings do not include the recording)."""
    import platform
    import statistics

    if json_out == "":
        raise click.UsageError("--json needs a file name ('-': the JSON on stdout)")
    if json_out and json_out != "-":  # refuse an unwritable path before minutes of work
        _check_writable(json_out)
    if record_routing:
        backend = routing.check_request(record_routing, backend)
    def fits(llm) -> None:  # lengths over the context are refused before the weights load
        if prompt_tokens + gen_tokens > llm.n_ctx:
            raise LocalMoEError(f"prompt {prompt_tokens} + {gen_tokens} tokens exceed the "
                                f"context {llm.n_ctx}; lower -p/-n or raise --ctx-size")
        if record_routing:
            routing.check_model(llm)

    llm = options.load_llm(model, backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v, device,
                           before_load=fits)
    try:
        # ~10 tokens per sentence: enough sentences for any --prompt-tokens
        text = ("The quick brown fox jumps over the lazy dog. " * max(400, prompt_tokens // 5))
        ids = llm.tokenizer.encode(text, add_special=False)[:prompt_tokens]
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
        if record_routing:  # one more, untimed run with the recorder installed
            rec = routing.recorder(llm)
            llm.reset()
            with rec:
                r = llm.generate(ids, max_tokens=gen_tokens, temperature=0.0,
                                 logit_bias={i: -100.0 for i in llm.tokenizer.eog_ids})
            routing.write(record_routing, llm, rec, [rec.take_trace("bench", "bench", r.text)],
                          "bench")
    finally:
        llm.close()
    for k, v in res.items():
        click.echo(f"{k:<20} {v:.2f}" if isinstance(v, float) else f"{k:<20} {v}",
                   err=json_out == "-")
    if json_out == "-":
        click.echo(json.dumps(res, indent=1))
    elif json_out:
        try:
            with open(json_out, "w") as f:
                json.dump(res, f, indent=1)
        except OSError as e:
            raise LocalMoEError(f"cannot write {json_out}: {e.strerror or e}") from None
