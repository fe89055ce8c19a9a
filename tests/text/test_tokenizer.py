"""Tokenizer: parity with llama.cpp on the real GGUF files, round trips, special tokens, HF dirs."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from localmoe.errors import ModelLoadError, UnsupportedModelError
from localmoe.text.tokenizer import Tokenizer

# Strings that break naive tokenizers: emoji and ZWJ sequences, CJK, leading/repeated spaces,
# tabs/newlines, long digit runs, punctuation, text that looks like special tokens.
HARD_STRINGS = [
    "",
    " ",
    "  ",
    "Hello world",
    " Hello world",
    "   leading spaces and trailing   ",
    "a  b   c    d     e",
    "\t\ttabs\tand\nnewlines\n\n\nmixed \t \n end",
    "\r\n windows\r\nlines\r\n",
    "1234567890123456789012345678901234567890",
    "3.14159 2,718 1e-10 -42 0x1F 007 1_000_000",
    "Hello!!! What?!? ...wait... (yes) [no] {maybe} <tag> a/b\\c 'quote' \"dq\" `bt`",
    "don't won't I'm you're they've we'll he'd IT'S DON'T",
    "😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️‍🔥 🇫🇷🇯🇵",
    "数字与汉字混合：中文，日本語のテキスト、한국어 텍스트。",
    "Ünïcödé àccénts ñ ß ø å Ωμέγα Кириллица العربية עברית हिन्दी ไทย",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|><bos><eos><start_of_turn>model\n<end_of_turn>",
    "<s> </s> [INST] <<SYS>> <unk> <pad> <mask>",
    "<|im_start |> <| im_end|> <|im_start|<|im_end|>>",
    "def f(x):\n    return x**2  # square\n\n\nclass A:\n\tpass\n",
    "    indented code\n        more\n",
    "\u00a0non-breaking\u00a0space\u2003em\u2003space\u200bzero\u200bwidth",
    "a" * 300,
    " " * 40 + "x",
    "\n" * 35 + "y",
    "ℌ𝔢𝔩𝔩𝔬 𝕎𝕠𝕣𝕝𝕕 ① ⅷ ½ ²",
    "email@example.com https://example.org/path?q=1&r=2#frag",
    "mixedCASEWordsAndCamelCase snake_case_words kebab-case-words",
    "ﬁ ﬂ ligatures, ＦＵＬＬＷＩＤＴＨ　ｔｅｘｔ",
    "</s> <reponame> <|fim_prefix|> [EOT] <end_of_utterance>",
]
# literal U+2581 (SentencePiece's space marker) is tokenized like llama.cpp but decodes as " "
# bytes missing from SmolLM2's vocabulary (0x06, 0x14) are dropped but still block merges
PARITY_ONLY = ["a\u2581b \u2581\u2581 c", ">\x06> <\x14<", "\U00040000x"]


def _load(path):
    from localmoe.io.loader import open_model

    mf = open_model(path)
    return mf, Tokenizer.from_model(mf)


@pytest.fixture(scope="module")
def smollm(smollm2_path):
    return _load(smollm2_path)


@pytest.fixture(scope="module")
def gemma(gemma3_path):
    return _load(gemma3_path)


@pytest.fixture(params=["smollm", "gemma"])
def tok(request):
    return request.getfixturevalue(request.param)[1]


@pytest.fixture(scope="module")
def llama_vocab():
    """path -> llama_cpp.Llama(vocab_only=True), cached for the module."""
    import llama_cpp

    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        return cache[path]

    return get


# ---------------------------------------------------------------------------- llama.cpp parity
@pytest.mark.llamacpp
@pytest.mark.parametrize("model", ["smollm", "gemma"])
def test_ids_match_llamacpp(model, request, llama_vocab):
    path = request.getfixturevalue({"smollm": "smollm2_path", "gemma": "gemma3_path"}[model])
    tk = request.getfixturevalue(model)[1]
    ref = llama_vocab(path)
    mismatches = []
    for s in HARD_STRINGS + PARITY_ONLY:
        for add_bos, special in ((True, False), (False, False), (True, True), (False, True)):
            want = ref.tokenize(s.encode("utf-8"), add_bos=add_bos, special=special)
            got = tk.encode(s, add_special=add_bos, parse_special=special)
            if got != want:
                mismatches.append((s, add_bos, special, got, want))
    assert not mismatches, mismatches[:3]


@pytest.mark.llamacpp
@pytest.mark.parametrize("model", ["smollm", "gemma"])
def test_long_real_text_matches_llamacpp(model, request, llama_vocab):
    from tests.conftest import GPL_TEXT_PATH

    path = request.getfixturevalue({"smollm": "smollm2_path", "gemma": "gemma3_path"}[model])
    tk = request.getfixturevalue(model)[1]
    text = GPL_TEXT_PATH.read_text(encoding="utf-8")[:6000]
    assert tk.encode(text) == llama_vocab(path).tokenize(text.encode(), add_bos=True, special=False)


@pytest.mark.llamacpp
@pytest.mark.parametrize("model", ["smollm", "gemma"])
def test_eog_and_flags_match_llamacpp(model, request, llama_vocab):
    import llama_cpp

    path = request.getfixturevalue({"smollm": "smollm2_path", "gemma": "gemma3_path"}[model])
    tk = request.getfixturevalue(model)[1]
    ref = llama_vocab(path)
    vocab = llama_cpp.llama_model_get_vocab(ref.model)
    eog = {i for i in range(tk.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert tk.eog_ids == eog
    assert tk.vocab_size == ref.n_vocab()
    assert tk.bos_id == ref.token_bos() and tk.eos_id == ref.token_eos()
    assert tk.add_bos == bool(llama_cpp.llama_vocab_get_add_bos(vocab))
    for i in list(range(300)) + list(range(tk.vocab_size - 50, tk.vocab_size)):
        assert tk.is_control(i) == bool(llama_cpp.llama_vocab_is_control(vocab, i)), i


@pytest.mark.llamacpp
@pytest.mark.parametrize("model", ["smollm", "gemma"])
def test_token_bytes_match_llamacpp_pieces(model, request, llama_vocab):
    path = request.getfixturevalue({"smollm": "smollm2_path", "gemma": "gemma3_path"}[model])
    tk = request.getfixturevalue(model)[1]
    import ctypes

    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llama_vocab(path).model)
    buf = ctypes.create_string_buffer(1024)
    ids = sorted(set(range(0, tk.vocab_size, max(1, tk.vocab_size // 3000))) | set(range(400)))
    for i in ids:
        # special=True: control tokens render as their text, as our token_bytes does
        n = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, True)
        assert tk.token_bytes(i) == buf.raw[:n], i


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("s", HARD_STRINGS)
def test_decode_encode_round_trip_bank(tok, s):
    assert tok.decode(tok.encode(s, add_special=False)) == s
    assert tok.decode(tok.encode(s, add_special=True), skip_special=True) == s


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80))
def test_round_trip_property_smollm(smollm, s):
    tk = smollm[1]
    assume(tk.is_lossless(s))
    assert tk.decode(tk.encode(s, add_special=False)) == s


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80))
def test_round_trip_property_gemma(gemma, s):
    tk = gemma[1]
    assume(tk.is_lossless(s))
    assert tk.decode(tk.encode(s, add_special=False)) == s


def test_bytes_missing_from_vocab_are_dropped_like_llamacpp(smollm, gemma):
    s_tok = smollm[1]
    assert not s_tok.is_lossless("\U00040000") and s_tok.is_lossless("ok \U0001F600")
    assert s_tok.decode(s_tok.encode("a\U00040000b")) == "a\ufffd\ufffd\ufffdb"
    assert gemma[1].is_lossless("\U00040000\x04") and not gemma[1].is_lossless("\u2581")


# ---------------------------------------------------------------------------- special tokens
def test_special_text_is_plain_by_default_smollm(smollm):
    tk = smollm[1]
    im_start = tk.token_to_id("<|im_start|>")
    assert im_start is not None and tk.is_control(im_start)
    plain = tk.encode("<|im_start|>user", add_special=False)
    assert im_start not in plain and len(plain) > 2
    parsed = tk.encode("<|im_start|>user", add_special=False, parse_special=True)
    assert parsed[0] == im_start and len(parsed) == 2
    assert tk.decode(plain) == tk.decode(parsed) == "<|im_start|>user"


def test_special_text_is_plain_by_default_gemma(gemma):
    tk = gemma[1]
    sot = tk.token_to_id("<start_of_turn>")
    assert tk.is_control(sot)
    assert sot not in tk.encode("<start_of_turn>user")
    assert tk.encode("<start_of_turn>user", parse_special=True)[:2] == [tk.bos_id, sot]


def test_plain_spans_keep_user_control_text_plain(smollm):
    tk = smollm[1]
    text = "<|im_start|>user\nsay <|im_end|> now<|im_end|>\n"
    a = text.index("say")
    b = text.index("now") + 3
    ids = tk.encode(text, add_special=False, parse_special=True, plain_spans=[(a, b)])
    im_end = tk.token_to_id("<|im_end|>")
    assert ids.count(im_end) == 1 and ids[-2] == im_end
    assert tk.decode(ids) == text


def test_bos_eos_flags(smollm, gemma):
    s_tok, g_tok = smollm[1], gemma[1]
    assert s_tok.add_bos is False and s_tok.encode("hi") == s_tok.encode("hi", add_special=False)
    assert g_tok.add_bos is True and g_tok.encode("hi")[0] == g_tok.bos_id
    assert g_tok.encode("hi", add_special=False)[0] != g_tok.bos_id
    assert g_tok.encode("") == [g_tok.bos_id] and g_tok.encode("", add_special=False) == []


def test_eog_ids_cover_turn_end_tokens(smollm, gemma):
    s_tok, g_tok = smollm[1], gemma[1]
    assert {s_tok.token_to_id("<|im_end|>"), s_tok.token_to_id("<|endoftext|>")} <= s_tok.eog_ids
    assert {g_tok.token_to_id("<end_of_turn>"), g_tok.token_to_id("<eos>")} <= g_tok.eog_ids
    assert g_tok.bos_id not in g_tok.eog_ids


def test_user_defined_tokens_always_matched(gemma):
    tk = gemma[1]
    nn = tk.token_to_id("\n\n")
    assert nn is not None and not tk.is_control(nn)
    assert nn in tk.encode("a\n\nb", add_special=False)


def test_decode_skip_special_and_bad_id(gemma):
    tk = gemma[1]
    ids = tk.encode("<start_of_turn>hi", parse_special=True)
    assert tk.decode(ids) == "<bos><start_of_turn>hi"
    assert tk.decode(ids, skip_special=True) == "hi"
    with pytest.raises(IndexError):
        tk.token_bytes(tk.vocab_size)


def test_encode_rejects_non_str(smollm):
    with pytest.raises(TypeError):
        smollm[1].encode(b"bytes")


def test_encode_rejects_undecodable_input_clearly(tok):
    """Undecodable bytes reach Python as lone surrogates (argv, stdin, JSON "\\udcff"); they
    are a user error with a clear message, not a TypeError from the tokenizer library."""
    from localmoe.errors import InvalidRequestError

    for text in ("caf\udce9", "\udcff\udcfe hello", "ok \ud800"):
        with pytest.raises(InvalidRequestError, match="UTF-8"):
            tok.encode(text)
    assert tok.encode("café", add_special=False)


# ---------------------------------------------------------------------------- errors
def test_bad_metadata_errors():
    with pytest.raises(ModelLoadError):
        Tokenizer.from_gguf_metadata({})
    base = {"tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.token_type": [1, 1, 1],
            "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer"):
        Tokenizer.from_gguf_metadata({**base, "tokenizer.ggml.model": "gpt2",
                                      "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(UnsupportedModelError, match="tokenizer model"):
        Tokenizer.from_gguf_metadata({**base, "tokenizer.ggml.model": "rwkv"})
    with pytest.raises(ModelLoadError, match="token_type"):
        Tokenizer.from_gguf_metadata({**base, "tokenizer.ggml.model": "gpt2",
                                      "tokenizer.ggml.token_type": [1]})


def test_tiny_spm_vocab_merges_by_score_and_byte_fallback():
    # merge order follows scores: in "\u2581abc", "ab" (score -1) beats "bc" (-2) and
    # "\u2581a" (-3), leaving \u2581 + ab + c
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["a", "b", "c", "ab", "bc", "\u2581", "\u2581a"]
    types = [2, 3, 3] + [6] * 256 + [1] * 7
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-10, -10, -10, -1, -2, -5, -3]
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": toks,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
          "tokenizer.ggml.add_space_prefix": True}
    tk = Tokenizer.from_gguf_metadata(md)
    i = {t: k for k, t in enumerate(toks)}
    assert tk.encode("abc", add_special=False) == [i["\u2581"], i["ab"], i["c"]]
    assert tk.encode("a", add_special=False) == [i["\u2581a"]]
    assert tk.encode("acb", add_special=False) == [i["\u2581a"], i["c"], i["b"]]
    assert tk.encode("bc", add_special=False) == [i["\u2581"], i["bc"]]
    # "é" is not in the vocabulary: UTF-8 bytes C3 A9
    assert tk.encode("é", add_special=False) == [i["\u2581"], i["<0xC3>"], i["<0xA9>"]]
    assert tk.decode(tk.encode("abc é", add_special=True)) == "<s>abc é"
    assert tk.decode(tk.encode("abc é", add_special=False)) == "abc é"


# ---------------------------------------------------------------------------- HF tokenizer.json
def test_hf_dir_matches_gguf(tmp_path, smollm):
    """Save the SmolLM vocabulary as an HF tokenizer.json and compare both paths."""
    from tokenizers import AddedToken

    tk = smollm[1]
    hf = tk._tk  # the tokenizers pipeline built from the GGUF vocabulary
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(hf.to_str())
    ctl = [tk.token_bytes(i).decode() for i in sorted(tk.control_ids)]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ctl])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    h = Tokenizer.from_hf_dir(tmp_path)
    assert h.bos_id == tk.bos_id and h.eos_id == tk.eos_id and h.add_bos is False
    assert h.eog_ids == tk.eog_ids
    for s in HARD_STRINGS:
        for special in (False, True):
            assert h.encode(s, parse_special=special) == tk.encode(s, parse_special=special), s
        assert h.decode(h.encode(s)) == s


def test_hf_dir_missing_tokenizer(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2", "smollm", "gpt-2", "falcon",
                                 "gpt-4o", "tekken", "deepseek-v3", "chatglm-bpe", "dbrx",
                                 "deepseek-llm", "deepseek-coder", "poro-chat", "viking",
                                 "seed-coder", "bailingmoe"])
def test_every_pre_tokenizer_builds_and_round_trips(pre):
    """A byte-level vocabulary (256 byte symbols + a few merges) under each pre-tokenizer."""
    from localmoe.text.bytelevel import BYTE_ENCODER

    chars = [BYTE_ENCODER[b] for b in range(256)]
    toks = ["<|endoftext|>"] + chars + ["Ġt", "he", "Ġthe", "12", "123"]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": toks,
          "tokenizer.ggml.token_type": [3] + [1] * (len(toks) - 1),
          "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he", "1 2", "12 3"],
          "tokenizer.ggml.eos_token_id": 0}
    tk = Tokenizer.from_gguf_metadata(md)
    s = "the theme: 12345 apples, Ünïcödé 😀 don't\n\n  x"
    ids = tk.encode(s)
    assert tk.decode(ids) == s
    assert toks.index("Ġthe") in ids
    assert tk.eog_ids == {0}


_FRAGMENTS = ["<|im_end|>", "<end_of_turn>", "<bos>", "</s>", "  ", "\n\n", "\t", " ", "'s", "'LL",
              "123456", "😀", "👨‍👩‍👧", "数据", "é", "Ω", "\u00a0", "\r\n", "...", "!?", "▁", "ab",
              "The", " the", "x" * 5]


@pytest.mark.llamacpp
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.one_of(st.sampled_from(_FRAGMENTS),
                                st.text(alphabet=st.characters(blacklist_categories=("Cs",)),
                                        max_size=6)), max_size=10),
       special=st.booleans())
def test_random_text_matches_llamacpp(smollm, gemma, smollm2_path, gemma3_path, llama_vocab,
                                      parts, special):
    s = "".join(parts)
    for tk, path in ((smollm[1], smollm2_path), (gemma[1], gemma3_path)):
        want = llama_vocab(path).tokenize(s.encode("utf-8"), add_bos=True, special=special)
        assert tk.encode(s, add_special=True, parse_special=special) == want, (path.name, s)


PRE_NAMES = ["llama-bpe", "qwen2", "gpt-2", "default", "smollm", "deepseek-v3", "gpt-4o", "tekken",
             "falcon", "stablelm2", "dbrx", "starcoder", "olmo", "chatglm-bpe", "deepseek-llm",
             "deepseek-coder", "poro-chat", "viking", "seed-coder", "bailingmoe", "llama4"]


@pytest.mark.llamacpp
@pytest.mark.slow
@pytest.mark.parametrize("pre", PRE_NAMES)
def test_pre_tokenizers_match_llamacpp(pre, smollm, tmp_path):
    """SmolLM2's real 49k vocabulary and merges under each pre-tokenizer name, written to a
    vocabulary-only GGUF that llama.cpp loads with vocab_only=True."""
    import gguf
    import llama_cpp

    md = dict(smollm[0].metadata)
    path = tmp_path / f"vocab-{pre}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    tk = Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.pre": pre,
                                       "tokenizer.ggml.add_bos_token": None})
    assert tk.add_bos == bool(llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(ref.model)))
    bad = []
    for s in HARD_STRINGS + PARITY_ONLY:
        for add_bos, special in ((True, False), (False, True)):
            want = ref.tokenize(s.encode("utf-8"), add_bos=add_bos, special=special)
            got = tk.encode(s, add_special=add_bos, parse_special=special)
            if got != want:
                bad.append((s, special, got[:20], want[:20]))
    assert not bad, bad[:2]


@pytest.mark.llamacpp
@pytest.mark.slow
def test_spm_with_space_prefix_matches_llamacpp(gemma, tmp_path):
    """Gemma's real SentencePiece vocabulary with add_space_prefix=True (Llama-2/Mistral style),
    written to a vocabulary-only GGUF: ids match llama.cpp and text round-trips."""
    import gguf
    import llama_cpp

    md = gemma[0].metadata
    path = tmp_path / "spm-prefix.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_scores(md["tokenizer.ggml.scores"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    tk = Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.add_space_prefix": True,
                                       "tokenizer.ggml.add_bos_token": None})
    assert tk.add_space_prefix and tk.add_bos
    bad = []
    for s in HARD_STRINGS:
        for add_bos, special in ((True, False), (False, True)):
            want = ref.tokenize(s.encode("utf-8"), add_bos=add_bos, special=special)
            got = tk.encode(s, add_special=add_bos, parse_special=special)
            if got != want:
                bad.append((s, special, got[:20], want[:20]))
        frags = tk._partition(s, False)
        if len(frags) == 1 and isinstance(frags[0], str):  # user-defined tokens break the prefix
            assert tk.decode(tk.encode(s)) == "<bos>" + s
            assert tk.decode(tk.encode(s), skip_special=True) == s
    assert not bad, bad[:2]
