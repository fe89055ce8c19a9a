"""Shared fixtures: real model files, device and optional-package gating.

Real models are looked up, in order, in ``$LOCALMOE_TEST_MODELS`` (a folder holding the .gguf
files), then in the localmoe model store (``localmoe pull smollm2`` / ``gemma3-270m``). Under CI
(``CI`` set) a missing real model is a failure, not a skip, so a broken fetch cannot pass green.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from localmoe.testing.hf_kernels import installed_kernels_first

# Hugging Face's `kernels` (which transformers >= 5.25 imports) before anything else can import
# it: from the repository root, this checkout's kernels/ folder would shadow it
installed_kernels_first()

REAL_MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
}


def _find_real_model(short: str) -> Path | None:
    fname = REAL_MODELS[short]
    env = os.environ.get("LOCALMOE_TEST_MODELS")
    if env and (Path(env) / fname).is_file():
        return Path(env) / fname
    try:
        from localmoe.io.store import ModelStore

        p = ModelStore().find(short)
        if p is not None:
            return Path(p)
    except Exception:
        pass
    return None


def _real_model(short: str) -> Path:
    p = _find_real_model(short)
    if p is None:
        msg = f"real model {short} not found (run `localmoe pull {short}` or set LOCALMOE_TEST_MODELS)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return p


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _real_model("smollm2")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _real_model("gemma3-270m")


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def has_llamacpp() -> bool:
    try:
        import llama_cpp  # noqa: F401

        return True
    except Exception:
        return False


def raw_llama(*args, **kw):
    """``llama_cpp.Llama(*args, **kw)`` as the llamacpp backend loads it
    (:func:`localmoe.backends.llamacpp_backend.raw_llama`: on a build with AMX, without the
    extra CPU buffers whose matrix multiply crashes on some machines), so raw references and
    the backend compute alike and neither crashes."""
    from localmoe.backends.llamacpp_backend import raw_llama as load

    return load(*args, **kw)


def rewrite_gguf(src, dst, tensor, file_type: int | None = None):
    """Write ``dst``: GGUF ``src``'s metadata (``general.file_type`` set to ``file_type`` when
    given) and, for each of its tensors ``t``, ``tensor(t)`` = ``(array, raw_dtype or None)``
    (None: the array's own float type)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        if k == "general.file_type" and file_type is not None:
            w.add_uint32(k, file_type)
        elif f.types[0] == GGUFValueType.ARRAY:
            w.add_array(k, f.contents())
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    for t in r.tensors:
        data, raw = tensor(t)
        w.add_tensor(t.name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def retype_experts(src, dst, qtype, seed=0, scale=2e-4):
    """Write ``dst``: GGUF ``src`` with its routed experts' tensors replaced by random valid
    blocks of ``qtype`` (an i-quant whose fp16 ``d`` is the block's first field: IQ1_S,
    IQ2_*, IQ3_*; ``d`` = ``scale`` in every block, 0 for experts that contribute nothing)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]

    def tensor(t):
        if "_exps." not in t.name:
            return t.data, t.tensor_type
        shape = tuple(int(v) for v in reversed(t.shape))          # torch order
        b = rng.integers(0, 256, size=(int(np.prod(shape)) // bs, ts), dtype=np.uint8)
        b[:, 0:2] = np.full((b.shape[0], 1), scale, np.float16).view(np.uint8)
        return b.reshape(*shape[:-1], -1), qtype

    return rewrite_gguf(src, dst, tensor)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_llama = pytest.mark.skip(reason="llama-cpp-python not installed")
    cuda = has_cuda()
    llama = has_llamacpp()
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)
        if "llamacpp" in item.keywords and not llama:
            if os.environ.get("CI"):
                continue  # let it fail loudly in CI: the install step is broken
            item.add_marker(skip_llama)


GPL_TEXT_PATH = Path(__file__).parent / "data" / "gpl3_excerpt.txt"
