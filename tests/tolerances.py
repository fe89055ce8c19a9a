"""The test suite's tolerances for kernels, one table (docs TESTING.md, "Tolerances").

Kernels are checked against their plain-PyTorch twin; a quantized kernel's twin reads the same
packed bytes or rounds the activations the same way (dequant(quant(x)), DESIGN.md convention
3), so the bounds below hold arithmetic differences only, and quantization error has bounds of
its own (``QUANT_*``, ``ACT_QUANT_*``). Kernels vs their twin, per dtype of the kernel's
arithmetic: fp32 1e-5, fp16/bf16 1e-2, relative norm-wise (``|a - b| / |b|``) unless a line
says ``atol``. None of them may be loosened to make a test pass; where two tests used different
values for the same comparison, both are kept as separate entries.

======================  =======  ==========================================================
name                    value    bounds
======================  =======  ==========================================================
FP32                    1e-5     fp32 kernel against its twin: quantized GEMV and fused MoE
                                 in the interpreter (tests/kernels/test_quant_gemv.py,
                                 test_fused_moe.py); ``atol`` of the decode-attention twin
                                 against attention over the cache's own read
                                 (tests/kv/test_channel.py); the CPU C kernel (matmul, RMSNorm,
                                 attention) against torch (tests/cpu/test_qmatmul.py)
FP32_DEVICE             1e-4     the same fp32 comparisons in tests that run on the GPU when
                                 there is one: GEMV and fused MoE on the GPU; ``atol`` of
                                 the attention twin in tests/kv/test_channel_outliers.py
FP16                    1e-2     fp16 operands or outputs against the fp32 twin: decode
                                 attention (tests/kernels/test_decode_attention.py,
                                 tests/kv/test_channel_outliers.py), half GEMV outputs and
                                 float-weight GEMV; the least a change must move fused MoE
BF16                    1e-2     bf16 operands, as fp16 (fused MoE at full size on the GPU)
SPLITS                  1e-3     the same kernel with 1, 3 or 10 splits (atol and rtol)
MUST_DIFFER             10       a change the kernel must see (outlier values zeroed) moves
                                 the output by more than MUST_DIFFER x FP16
QUANT_INT8_VS_FLOAT     0.01     int8 cache attention against the f16 cache, end to end
                                 (int2 must be above it)
QUANT_INT4_VS_FLOAT     0.3      int4 cache attention against the f16 cache, as above
                                 (random data: averaged outputs have large relative errors)
ACT_QUANT_GEMV          3e-2     GEMV with int8-rounded activations against float ones
ACT_QUANT_MOE           6e-2     fused MoE against float activations (x and h both rounded)
ACT16_QUANT_GEMV        1e-3     GEMV and fused MoE with "int16" activations (int8 codes
                                 plus their rounding error's int8 codes, act_precision)
                                 against float ones: 254x finer than int8's rounding, so at
                                 least 10x under the int8 error of the same product
LOGITS_FP16_DOTS        0.1      max |logit delta| / max |logit| of the triton runner (fp16
                                 dot operands, 30 layers) against the torch runner
APPEND_CODES_GPU        1e-3     fraction of packed code bytes the append kernel may write
                                 differently from its twin on the GPU (division rounding at
                                 an exact half-way point); 0 in the interpreter
FUSED_APPEND_GPU        2e-2     fraction of store bytes (at least 2 per tensor) and of
                                 decoded values the fused q/k norm + RoPE + KV append kernel
                                 may write differently from its twin on the GPU (the norm's
                                 float32 sum order and FMA move a k value by one fp16 unit,
                                 so a code or a group scale by one step); 0 in the interpreter
FUSED_QUANT_KV_GPU      0.1      max |logit delta| / max |logit| of the fused decode step
                                 against the shared block with a quantized KV cache on the
                                 GPU: the two paths' fp16 rounding moves int4 codes by a
                                 step (as FUSED_APPEND_GPU), and a moved code moves the next
                                 layers' input; measured 3.5-5.5% per step on tiny-olmoe and
                                 tiny-qwen3moe with int4 KV, where each path is 3.8-5.0% from
                                 the torch runner over the same cache format (4.4% in fp32 in
                                 the interpreter, where the two paths are bit-identical);
                                 f16/int8 KV: 0.7-1.2%. Not used in the interpreter
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
ACT_QUANT_GEMV = 3e-2
ACT_QUANT_MOE = 6e-2
ACT16_QUANT_GEMV = 1e-3
LOGITS_FP16_DOTS = 0.1
APPEND_CODES_GPU = 1e-3
FUSED_APPEND_GPU = 2e-2
FUSED_QUANT_KV_GPU = 0.1
