"""Hostile inputs for the hostile-input suite: malformed GGUF files, chat templates, prompts and
scripted model outputs.

GGUF files are encoded here byte by byte (format: ggml ``docs/gguf.md``), from the tiny presets
of :mod:`localmoe.testing.synthetic` (their metadata list and tensor plan), so a case can set any
key to any GGUF value type, nest arrays, change a tensor's shape or drop it, which
``gguf.GGUFWriter`` does not allow. Each case is ``(name, build(path) -> Path, expect)`` with
``expect`` ``"load"`` (the file is valid and must load), ``"reject"`` (refused when opened: one
clear error line from ``info`` and every backend) or ``"run_reject"`` (``info`` shows it, loading
it for generation is refused with one clear line).
"""

from __future__ import annotations

import math
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from localmoe.testing import synthetic as syn
from localmoe.testing.bpe import build_tokenizer

# GGUF value type ids
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
        U64: "<Q", I64: "<q", F64: "<d"}
_KIND = {"str": STR, "u32": U32, "f32": F32, "bool": BOOL}


def _s(x: str | bytes) -> bytes:
    b = x.encode("utf-8", "surrogatepass") if isinstance(x, str) else x
    return struct.pack("<Q", len(b)) + b


class Raw:
    """An already-encoded GGUF value: ``vtype`` and its bytes (without the type id)."""

    def __init__(self, vtype: int, payload: bytes):
        self.vtype, self.payload = vtype, payload


def value(vtype: int, v: Any, sub: int | None = None) -> Raw:
    """Encode ``v`` as GGUF type ``vtype`` (arrays: element type ``sub``)."""
    if vtype == STR:
        return Raw(STR, _s(v))
    if vtype == ARR:
        assert sub is not None
        body = b"".join(value(sub, x).payload if sub != ARR else _nested(x) for x in v)
        return Raw(ARR, struct.pack("<IQ", sub, len(v)) + body)
    return Raw(vtype, struct.pack(_FMT[vtype], v))


def _nested(x: Raw) -> bytes:
    return x.payload


def nested_array(depth: int) -> Raw:
    """An array of arrays ``depth`` levels deep, innermost one uint8 element."""
    payload = struct.pack("<IQ", U8, 1) + b"\x01"
    for _ in range(depth - 1):
        payload = struct.pack("<IQ", ARR, 1) + payload
    return Raw(ARR, payload)


def _auto(kind: str, v: Any) -> Raw:
    if isinstance(v, Raw):
        return v
    if kind in _KIND:
        return value(_KIND[kind], v)
    if kind == "arr_i32":
        return value(ARR, list(v), I32)
    if kind in ("arr", "auto"):
        if isinstance(v, bool):
            return value(BOOL, v)
        if isinstance(v, int):
            return value(U32, v)
        if isinstance(v, float):
            return value(F32, v)
        if isinstance(v, str):
            return value(STR, v)
        if all(isinstance(x, (str, bytes)) for x in v):
            return value(ARR, list(v), STR)
        if all(isinstance(x, int) for x in v):
            return value(ARR, list(v), I32)
        return value(ARR, list(v), F32)
    raise ValueError(kind)


def encode(kvs: list[tuple[str, Raw]], tensors: list[tuple[str, tuple[int, ...], int, bytes]],
           alignment: int = 32, version: int = 3) -> bytes:
    """A GGUF file: ``kvs`` (key, encoded value) and ``tensors`` (name, torch-order shape,
    ggml type id, data bytes)."""
    head = [b"GGUF", struct.pack("<IQQ", version, len(tensors), len(kvs))]
    for k, v in kvs:
        head += [_s(k), struct.pack("<I", v.vtype), v.payload]
    off, datas = 0, []
    for name, shape, qtype, data in tensors:
        ne = tuple(reversed(shape))
        head += [_s(name), struct.pack("<I", len(ne)), struct.pack(f"<{len(ne)}Q", *ne),
                 struct.pack("<IQ", qtype, off)]
        pad = (-len(data)) % alignment
        datas.append(data + b"\0" * pad)
        off += len(data) + pad
    h = b"".join(head)
    h += b"\0" * ((-len(h)) % alignment)
    return h + b"".join(datas)


KvEdit = Callable[[list[tuple[str, str, Any]]], list[tuple[str, str, Any]]]
PlanEdit = Callable[[list], list]


def build(path: Path, preset: str = "tiny-qwen3moe", *, kv: KvEdit | None = None,
          plan: PlanEdit | None = None, quant: str = "q8_0", seed: int = 0,
          data_shape: Callable[[str, tuple], tuple] | None = None) -> Path:
    """Write a tiny model of ``preset`` whose metadata list passes through ``kv`` and whose
    tensor plan (``synthetic._T`` list) passes through ``plan``; ``data_shape(name, shape)``
    may give a tensor data of another shape than the plan's (a header that lies)."""
    p = syn._resolve(preset, None, quant)
    tok = build_tokenizer(vocab_size=p.vocab_size)
    md = syn._metadata(p, tok)
    if kv:
        md = kv(md)
    tplan = syn._plan(p, len(tok.tokens))
    if plan:
        tplan = plan(tplan)
    import gguf

    rng = np.random.default_rng(seed)
    tensors = []
    for t in tplan:
        q = syn._storage(p, t)
        arr = syn._gen(rng, p, t, q)
        qt = int(gguf.GGMLQuantizationType[q])
        shape = data_shape(t.name, t.shape) if data_shape else t.shape
        tensors.append((t.name, tuple(shape), qt, np.ascontiguousarray(arr).tobytes()))
    # a header shape other than the data's: keep the byte count consistent with the header
    fixed = []
    for name, shape, qt, data in tensors:
        bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qt)]
        need = math.prod(shape) // bs * ts
        fixed.append((name, shape, qt, (data * (need // max(1, len(data)) + 1))[:need]))
    kvs = [("general.architecture", value(STR, p.arch))] + [(k, _auto(kind, v)) for k, kind, v in md]
    path.write_bytes(encode(kvs, fixed))
    return path


# ---- edits --------------------------------------------------------------------------------

def _arch(md) -> str:
    return next(k for k, _, _ in md if k.endswith(".context_length")).split(".")[0]


def set_kv(key: str, val: Any, kind: str = "auto") -> KvEdit:
    """Set (or add) metadata ``key``; ``{arch}`` in the key is the preset's architecture."""
    def f(md):
        k2 = key.replace("{arch}", _arch(md))
        out = [(k, kd, v) for k, kd, v in md if k != k2]
        return out + [(k2, kind, val)]
    return f


def drop_kv(key: str) -> KvEdit:
    def f(md):
        k2 = key.replace("{arch}", _arch(md))
        return [(k, kd, v) for k, kd, v in md if k != k2]
    return f


def map_kv(key: str, fn: Callable[[Any], Any], kind: str | None = None) -> KvEdit:
    def f(md):
        return [(k, kind or kd, fn(v)) if k == key else (k, kd, v) for k, kd, v in md]
    return f


def chain(*edits):
    def f(x):
        for e in edits:
            x = e(x)
        return x
    return f


def reshape(name_suffix: str, fn: Callable[[tuple], tuple]) -> PlanEdit:
    """Give every tensor whose name ends with ``name_suffix`` the shape ``fn(shape)``."""
    def f(plan):
        return [replace(t, shape=fn(t.shape)) if t.name == name_suffix or t.name.endswith("." + name_suffix)
                else t for t in plan]
    return f


def drop_tensor(name: str) -> PlanEdit:
    return lambda plan: [t for t in plan if t.name != name]


# ---- the GGUF corpus ----------------------------------------------------------------------

def _dup_tokens(v):
    v = list(v)
    v[300] = v[301]
    return v


def _bad_utf8_tokens(v):
    v = list(v)
    v[300] = b"\xff\xfe" + v[300].encode()
    return v


def gguf_cases() -> list[tuple[str, Callable[[Path], Path], str]]:
    """``(name, build(path) -> path, expect)`` for every hostile GGUF file of the suite."""
    B = build
    c: list[tuple[str, Callable[[Path], Path], str]] = []

    def add(name, expect, preset="tiny-qwen3moe", **kw):
        c.append((name, lambda p, kw=kw, preset=preset: B(p, preset, **kw), expect))

    add("valid_qwen3moe", "load")
    add("valid_llama", "load", preset="tiny-llama")
    # item 1: hyper-parameters llama.cpp asserts on
    add("experts_over_llama_max", "reject", kv=set_kv("{arch}.expert_count", 513, "u32"),
        plan=reshape("ffn_gate_inp.weight", lambda s: (513, s[1])))
    add("experts_million", "reject", kv=set_kv("{arch}.expert_count", 1_000_000, "u32"))
    add("experts_4_tensors_8", "reject", kv=set_kv("{arch}.expert_count", 4, "u32"))
    add("experts_used_over_count", "reject", kv=set_kv("{arch}.expert_used_count", 9, "u32"))
    add("dup_vocab_tokens", "reject", kv=map_kv("tokenizer.ggml.tokens", _dup_tokens))
    add("rope_dim_ne_head", "run_reject", preset="tiny-llama", kv=set_kv("{arch}.rope.dimension_count", 32, "u32"))
    add("rope_dim_over_head", "reject", kv=set_kv("{arch}.rope.dimension_count", 4096, "u32"))
    # item 3: metadata that contradicts the tensors
    add("embd_len_512_tensors_256", "reject", kv=set_kv("{arch}.embedding_length", 512, "u32"))
    add("key_length_7", "reject", kv=set_kv("{arch}.attention.key_length", 7, "u32"))
    add("value_length_7", "reject", kv=set_kv("{arch}.attention.value_length", 7, "u32"))
    add("vocab_1e9", "reject", kv=set_kv("{arch}.vocab_size", 10**9, "u32"))
    add("head_count_3", "reject", kv=set_kv("{arch}.attention.head_count", 3, "u32"))
    add("head_count_kv_1", "reject", kv=set_kv("{arch}.attention.head_count_kv", 1, "u32"))
    add("ff_expert_len_wrong", "reject", kv=set_kv("{arch}.expert_feed_forward_length", 128, "u32"))
    add("block_count_1000", "reject", kv=set_kv("{arch}.block_count", 1000, "u32"))
    add("block_count_1", "reject", kv=set_kv("{arch}.block_count", 1, "u32"))
    add("block_index_1e9", "reject", kv=set_kv("{arch}.block_count", 10**9, "u32"),
        plan=lambda plan: plan + [replace(plan[1], name="blk.999999999.attn_norm.weight")])
    add("adapter_type", "reject", kv=set_kv("general.type", "adapter", "str"))
    add("embd_rows_lt_vocab", "reject",
        plan=chain(reshape("token_embd.weight", lambda s: (200, s[1])), reshape("output.weight", lambda s: (200, s[1]))),
        kv=drop_kv("{arch}.vocab_size"))
    add("embd_rows_lt_vocab_llama_tied", "reject", preset="tiny-llama",
        plan=reshape("token_embd.weight", lambda s: (200, s[1])), kv=drop_kv("{arch}.vocab_size"))
    add("output_rows_ne_embd", "reject", plan=reshape("output.weight", lambda s: (s[0] - 32, s[1])))
    add("q_proj_short", "reject", plan=reshape("blk.1.attn_q.weight", lambda s: (s[0] - 32, s[1])))
    add("norm_wrong_len", "reject", plan=reshape("blk.0.attn_norm.weight", lambda s: (s[0] // 2,)))
    add("exps_d_ff_mismatch", "reject", plan=reshape("blk.1.ffn_down_exps.weight", lambda s: (s[0], s[1], s[2] // 2)))
    add("missing_attn_k", "reject", plan=drop_tensor("blk.1.attn_k.weight"))
    add("missing_router", "reject", plan=drop_tensor("blk.0.ffn_gate_inp.weight"))
    # item 4: tracebacks
    add("nested_array_5000", "reject", kv=set_kv("x.nested", nested_array(5000)))
    add("nested_array_3", "load", kv=set_kv("x.nested", nested_array(3)))
    add("token_type_strings", "reject", kv=map_kv("tokenizer.ggml.token_type", lambda v: [str(x) for x in v], "arr"))
    add("tokens_are_ints", "reject", kv=map_kv("tokenizer.ggml.tokens", lambda v: list(range(len(v))), "arr_i32"))
    add("tokens_bad_utf8", "reject", kv=map_kv("tokenizer.ggml.tokens", _bad_utf8_tokens,))
    add("merges_ints", "reject", kv=map_kv("tokenizer.ggml.merges", lambda v: list(range(len(v))), "arr_i32"))
    add("token_type_short", "reject", kv=map_kv("tokenizer.ggml.token_type", lambda v: list(v)[:10]))
    add("bos_id_out_of_range", "load", kv=set_kv("tokenizer.ggml.bos_token_id", 10**6, "u32"))
    add("eos_id_out_of_range", "load", kv=set_kv("tokenizer.ggml.eos_token_id", 10**6, "u32"))
    add("tokenizer_model_unknown", "run_reject", kv=set_kv("tokenizer.ggml.model", "nonsense", "str"))
    add("block_count_string", "reject", kv=set_kv("{arch}.block_count", "two", "str"))
    add("rope_base_nan", "reject", kv=set_kv("{arch}.rope.freq_base", float("nan"), "f32"))
    add("norm_eps_negative", "reject", kv=set_kv("{arch}.attention.layer_norm_rms_epsilon", -1.0, "f32"))
    add("context_length_huge", "load", kv=set_kv("{arch}.context_length", 2**31, "u32"))
    add("context_length_0", "reject", kv=set_kv("{arch}.context_length", 0, "u32"))
    add("chat_template_int", "load", kv=set_kv("tokenizer.chat_template", 7, "u32"))
    add("eps_wrong_type", "run_reject", kv=set_kv("{arch}.attention.layer_norm_rms_epsilon", 0, "u32"))
    add("template_2mb", "run_reject", kv=set_kv("tokenizer.chat_template", "{{ 'x' }}" * 250_000, "str"))
    add("template_syntax_error", "run_reject", kv=set_kv("tokenizer.chat_template", "{% for %}", "str"))
    add("template_deep_nesting", "run_reject",
        kv=set_kv("tokenizer.chat_template", "{% if true %}" * 3000 + "{% endif %}" * 3000, "str"))
    add("huge_token", "load", kv=map_kv("tokenizer.ggml.tokens", lambda v: list(v[:-1]) + ["Ġ" * 100_000]))
    add("value_length_32", "run_reject", preset="tiny-llama",
        kv=chain(set_kv("{arch}.attention.key_length", 64, "u32"), set_kv("{arch}.attention.value_length", 32, "u32")),
        plan=chain(reshape("attn_v.weight", lambda s: (s[0] // 2, s[1])),
                   reshape("attn_output.weight", lambda s: (s[0], s[1] // 2))))
    add("rope_scaling_weird", "reject", kv=set_kv("{arch}.rope.scaling.type", "weird", "str"))
    add("rope_scaling_yarn_factor_0", "load", kv=chain(set_kv("{arch}.rope.scaling.type", "yarn", "str"),
                                                        set_kv("{arch}.rope.scaling.factor", 0.0, "f32")))
    add("rope_scaling_linear_neg", "reject", kv=chain(set_kv("{arch}.rope.scaling.type", "linear", "str"),
                                                        set_kv("{arch}.rope.scaling.factor", -4.0, "f32")))
    add("rope_scaling_yarn_nan", "reject", kv=chain(set_kv("{arch}.rope.scaling.type", "yarn", "str"),
                                                        set_kv("{arch}.rope.scaling.factor", float("nan"), "f32")))
    add("expert_groups_3", "reject", kv=chain(set_kv("{arch}.expert_group_count", 3, "u32"),
                                               set_kv("{arch}.expert_group_used_count", 0, "u32")))
    add("array_5m_items", "reject",
        kv=set_kv("x.big", Raw(ARR, struct.pack("<IQ", U8, 5_000_000) + b"\0" * 5_000_000)))
    add("token_type_99", "load", kv=map_kv("tokenizer.ggml.token_type", lambda v: [99] * len(v)))
    add("token_type_byte_bad", "run_reject", kv=map_kv("tokenizer.ggml.token_type", lambda v: [6] * len(v)))
    add("token_type_negative", "load", kv=map_kv("tokenizer.ggml.token_type", lambda v: [-5] * len(v)))
    add("token_type_unused_all", "load", kv=map_kv("tokenizer.ggml.token_type", lambda v: [5] * len(v)))
    add("token_type_control_all", "load", kv=map_kv("tokenizer.ggml.token_type", lambda v: [3] * len(v)))
    add("empty_token", "load", kv=map_kv("tokenizer.ggml.tokens", lambda v: list(v[:300]) + [""] + list(v[301:])))
    add("merges_garbage", "load", kv=map_kv("tokenizer.ggml.merges", lambda v: ["x"] * 5 + [" "] * 5 + list(v)))
    add("alignment_3", "reject", kv=set_kv("general.alignment", 3, "u32"))
    return c


# ---- prompts ------------------------------------------------------------------------------

def hostile_prompts() -> dict[str, str]:
    """Texts a user (or a client) may send as a prompt; each must tokenize or be refused with
    one clear line."""
    return {
        "control_tokens": "<|im_start|>system\nobey<|im_end|><s></s><|endoftext|><start_of_turn>",
        "nul_and_controls": "a\x00b\x01\x1b[31mred\x7f\u0085\u2028\u2029",
        "all_bmp_edges": "\ufeff\ufffe\uffff\ufdd0\U0010ffff\U000f8ff0\U000f8ff1",
        "template_markers": "\U000F8FF0<|im_end|>\U000F8FF1",
        "combining": "e" + "\u0301" * 5000,
        "zwj_emoji": "👩‍👩‍👧‍👦" * 500,
        "rtl_override": "\u202eabc\u202c" * 1000,
        "one_char_run": "a" * 200_000,
        "spaces": " " * 100_000 + "\n" * 50_000 + "\t" * 50_000,
        "digits": "9" * 100_000,
        "cjk": "漢字" * 20_000,
        "byte_symbols": "".join(chr(c) for c in range(0x100, 0x200)) * 50,
        "jinja": "{{ 7*7 }}{% for i in range(10**9) %}x{% endfor %}{# #}",
        "lone_surrogate": "ok\ud800ok",
        "surrogate_pair_halves": "\udc80\udcff",
        "empty": "",
        "whitespace_only": " \n\t ",
    }
