"""The test suite's tolerances for kernels, one table (docs TESTING.md, "Tolerances").

Kernels are checked against their plain-PyTorch twin; a quantized kernel's twin reads the same
packed bytes (dequant(quant(x)), DESIGN.md convention 3), so the bounds below hold arithmetic
differences only, and quantization error has bounds of its own (``QUANT_*``). Kernels vs their
twin, per dtype of the kernel's arithmetic: fp32 1e-5, fp16/bf16 1e-2 relative, norm-wise
(``|a - b| / |b|``); none of them may be loosened to make a test pass.

======================  =======  ==========================================================
name                    value    bounds
======================  =======  ==========================================================
KERNEL_VS_TWIN["fp32"]  1e-5     fp32 against fp32 (``allclose`` atol): the decode-attention
                                 twin against softmax attention over the cache's own read
                                 (tests/kv/test_channel.py)
FP32_DEVICE             1e-4     the same comparison where it runs on the GPU when there is
                                 one (tests/kv/test_channel_outliers.py; atol)
KERNEL_VS_TWIN["fp16"]  1e-2     kernel with fp16 dot operands against the fp32 twin,
                                 relative norm-wise (tests/kernels/test_decode_attention.py,
                                 tests/kv/test_channel_outliers.py)
KERNEL_VS_TWIN["bf16"]  1e-2     bf16 operands, as fp16 (TESTING.md)
SPLITS                  1e-3     the same kernel with 1, 3 or 10 splits (atol and rtol)
MUST_DIFFER             10       a change the kernel must see (outlier values zeroed) moves
                                 the output by more than MUST_DIFFER x KERNEL_VS_TWIN["fp16"]
QUANT_INT8_VS_FLOAT     0.01     int8 cache attention against the f16 cache, relative
                                 norm-wise, end to end (int2 must be above it)
QUANT_INT4_VS_FLOAT     0.3      int4 cache attention against the f16 cache, as above
                                 (random data: averaged outputs have large relative errors)
LOGITS_FP16_DOTS        0.1      max |logit delta| / max |logit| of the triton runner (fp16
                                 dot operands, 30 layers) against the torch runner
APPEND_CODES_GPU        1e-3     fraction of packed code bytes the append kernel may write
                                 differently from its twin on the GPU (division rounding at
                                 an exact half-way point); 0 in the interpreter
======================  =======  ==========================================================

Logits against llama.cpp and Hugging Face (top-1 agreement, log-softmax deltas) are bounded in
the parity tests (tests/model/test_parity_*.py).
"""

KERNEL_VS_TWIN = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 1e-2}
FP32 = KERNEL_VS_TWIN["fp32"]
FP16 = KERNEL_VS_TWIN["fp16"]
BF16 = KERNEL_VS_TWIN["bf16"]
FP32_DEVICE = 1e-4
SPLITS = 1e-3
MUST_DIFFER = 10
QUANT_INT8_VS_FLOAT = 0.01
QUANT_INT4_VS_FLOAT = 0.3
LOGITS_FP16_DOTS = 0.1
APPEND_CODES_GPU = 1e-3
