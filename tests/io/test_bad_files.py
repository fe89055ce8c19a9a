"""Bad model files: each is a clear ModelLoadError, never a crash, nothing allocated beyond the header."""

from __future__ import annotations

import os
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localmoe.errors import LocalMoEError, ModelLoadError, UnsupportedModelError
from localmoe.io.loader import open_model
from localmoe.testing.synthetic import write_gguf

HEADER_BUDGET = 16 * 2**20  # bytes of Python/numpy allocation allowed while rejecting a file


def _open_measured(path) -> tuple[Exception, int]:
    """open_model(path) must raise; returns (exception, peak bytes allocated meanwhile)."""
    tracemalloc.start()
    try:
        open_model(path)
    except Exception as e:  # noqa: BLE001 - the type is asserted by the caller
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return e, peak
    tracemalloc.stop()
    raise AssertionError(f"{path} opened without error")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("bad") / "tiny.gguf", "tiny-qwen3moe", seed=2)


def _patch_tensor_type(src: Path, dst: Path, tensor: str, new_type: int) -> None:
    """Copy src to dst with the ggml type id of ``tensor`` set to new_type (header edit)."""
    b = bytearray(src.read_bytes())
    name = tensor.encode()
    i = b.find(struct.pack("<Q", len(name)) + name)
    assert i > 0
    pos = i + 8 + len(name)
    n_dims = struct.unpack_from("<I", b, pos)[0]
    pos += 4 + 8 * n_dims
    struct.pack_into("<I", b, pos, new_type)
    dst.write_bytes(bytes(b))


def _patch_kv_u16(path: Path, key: str, value: int) -> None:
    b = bytearray(path.read_bytes())
    k = key.encode()
    i = b.find(struct.pack("<Q", len(k)) + k)
    assert i > 0
    pos = i + 8 + len(k)
    vtype = struct.unpack_from("<I", b, pos)[0]
    assert vtype == 2  # UINT16, as GGUFWriter writes split keys
    struct.pack_into("<H", b, pos + 4, value)
    path.write_bytes(bytes(b))


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    e, peak = _open_measured(p)
    assert isinstance(e, ModelLoadError) and "empty" in str(e) and "empty.gguf" in str(e)


@pytest.mark.parametrize("kind", ["character device", "named pipe"])
def test_a_device_or_pipe_is_not_a_regular_file(tmp_path, kind):
    """/dev/zero (a character device, st_size 0) was reported as an "empty (0 bytes)"
    download to fetch again, and so was a named pipe: both are "not a regular file", naming
    the kind, without reading from it (a FIFO would block)."""
    if kind == "named pipe":
        p = tmp_path / "pipe.gguf"
        os.mkfifo(p)
    else:
        p = Path("/dev/zero")
        if not p.is_char_device():
            pytest.skip("no /dev/zero")
    e, _ = _open_measured(p)
    assert isinstance(e, ModelLoadError), e
    assert f"{p} is not a regular file ({'a ' + kind}" in str(e), str(e)
    assert "empty" not in str(e) and "fetch" not in str(e), str(e)


def test_random_64_bytes(tmp_path):
    p = tmp_path / "rand.gguf"
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8).tobytes())
    e, peak = _open_measured(p)
    assert isinstance(e, ModelLoadError) and f"{p} is not a GGUF file" in str(e), str(e)
    assert peak < HEADER_BUDGET   # (the whole path, as the empty- and missing-file errors)


def test_html_page_named_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head><body>nope</body></html>\n")
    e, _ = _open_measured(p)
    assert isinstance(e, ModelLoadError)
    assert "HTML" in str(e) and "not a GGUF file" in str(e) and "again" in str(e)


def test_real_file_truncated_to_half(tmp_path, smollm2_path):
    p = tmp_path / "half.gguf"
    size = smollm2_path.stat().st_size
    with open(smollm2_path, "rb") as fi, open(p, "wb") as fo:
        fo.write(fi.read(size // 2))
    e, peak = _open_measured(p)
    assert isinstance(e, ModelLoadError)
    msg = str(e)
    assert "truncated" in msg and "past the end" in msg and "weight" in msg  # names the first tensor out of bounds
    # the header (49k tokens, 49k merges) is parsed, but no tensor data is touched or copied
    assert peak < HEADER_BUDGET


def test_tiny_file_truncated_inside_header(tmp_path, tiny):
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny.read_bytes()[:3000])
    e, peak = _open_measured(p)
    assert isinstance(e, ModelLoadError) and "ends inside the header" in str(e)
    assert peak < HEADER_BUDGET


def test_type_id_99(tmp_path, tiny):
    p = tmp_path / "t99.gguf"
    _patch_tensor_type(tiny, p, "blk.0.attn_q.weight", 99)
    e, peak = _open_measured(p)
    assert isinstance(e, ModelLoadError)
    assert "blk.0.attn_q.weight" in str(e) and "99" in str(e)
    assert peak < HEADER_BUDGET


def test_known_but_unsupported_type(tmp_path, tiny):
    # Q8_0 -> I8 (24): fewer bytes, so bounds stay valid; the type itself (an integer tensor,
    # no weight format) is refused
    p = tmp_path / "mx.gguf"
    _patch_tensor_type(tiny, p, "blk.0.attn_q.weight", 24)
    e, _ = _open_measured(p)
    assert isinstance(e, UnsupportedModelError)
    assert "blk.0.attn_q.weight" in str(e) and "I8" in str(e) and "24" in str(e)


def test_absurd_counts_rejected_before_allocation(tmp_path, tiny):
    b = bytearray(tiny.read_bytes())
    struct.pack_into("<Q", b, 8, 2**60)  # tensor_count
    p = tmp_path / "count.gguf"
    p.write_bytes(bytes(b))
    e, peak = _open_measured(p)
    assert isinstance(e, ModelLoadError) and "cannot fit" in str(e)
    assert peak < HEADER_BUDGET


def test_huge_string_length_rejected(tmp_path, tiny):
    b = bytearray(tiny.read_bytes())
    struct.pack_into("<Q", b, 24, 2**40)  # length of the first key string
    p = tmp_path / "str.gguf"
    p.write_bytes(bytes(b))
    e, peak = _open_measured(p)
    assert isinstance(e, ModelLoadError) and "ends inside the header" in str(e)
    assert peak < HEADER_BUDGET


def test_bad_version(tmp_path, tiny):
    b = bytearray(tiny.read_bytes())
    struct.pack_into("<I", b, 4, 7)
    p = tmp_path / "v7.gguf"
    p.write_bytes(bytes(b))
    with pytest.raises(UnsupportedModelError, match="version 7"):
        open_model(p)
    # a version no GGUF has had is noise in a corrupt file, not a format to re-convert
    struct.pack_into("<I", b, 4, 1726768829)
    p.write_bytes(bytes(b))
    with pytest.raises(ModelLoadError, match="corrupt or not a GGUF model") as e:
        open_model(p)
    assert not isinstance(e.value, UnsupportedModelError)


@pytest.fixture()
def split_set(tmp_path) -> list[Path]:
    first = write_gguf(tmp_path / "m.gguf", "tiny-llama", seed=4, split_max_tensors=8)
    shards = sorted(first.parent.glob("m-*-of-*.gguf"))
    assert len(shards) == 3
    return shards


@pytest.mark.parametrize("open_idx", [0, 2])
def test_missing_shard(split_set, open_idx):
    os.remove(split_set[1])
    e, peak = _open_measured(split_set[open_idx])
    assert isinstance(e, ModelLoadError)
    assert split_set[1].name in str(e) and "missing" in str(e)
    assert peak < HEADER_BUDGET


def test_inconsistent_split_count(split_set):
    _patch_kv_u16(split_set[1], "split.count", 5)
    e, _ = _open_measured(split_set[0])
    assert isinstance(e, ModelLoadError)
    assert "split.count = 5" in str(e) and split_set[1].name in str(e)


def test_shard_out_of_order(split_set, tmp_path):
    # swap shards 2 and 3 by name: split.no no longer matches the file name
    a, b = split_set[1], split_set[2]
    tmp = tmp_path / "swap"
    shutil.move(a, tmp)
    shutil.move(b, a)
    shutil.move(tmp, b)
    e, _ = _open_measured(split_set[0])
    assert isinstance(e, ModelLoadError) and "split.no" in str(e)


def test_nonexistent_and_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        open_model(tmp_path / "missing.gguf")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_header_corruption_never_crashes(tmp_path_factory, tiny, data):
    """Property: any corrupted header byte gives a valid model or a LocalMoEError, nothing else."""
    raw = bytearray(tiny.read_bytes())
    header_end = 14000  # metadata + tensor infos of the tiny file live in the first ~14 kB
    n = data.draw(st.integers(1, 4))
    for _ in range(n):
        pos = data.draw(st.integers(4, header_end))
        raw[pos] = data.draw(st.integers(0, 255))
    p = tmp_path_factory.mktemp("fuzz") / "f.gguf"
    p.write_bytes(bytes(raw))
    try:
        m = open_model(p)
    except LocalMoEError as e:
        assert str(e)
        return
    m.close()
