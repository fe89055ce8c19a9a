"""Torch backend vs HF transformers' own implementations on tiny random safetensors checkpoints
(Qwen3-MoE, Qwen2-MoE with shared expert, OLMoE, Mixtral, Llama), written by
``localmoe.testing.synthetic.write_hf`` (the model is built and saved by transformers itself).

Both sides compute in float32 on the same weights (HF on the CPU; ours on the CPU, and on CUDA
when present), so the bound is tight: max |log_softmax(ours) - log_softmax(hf)| <= 1e-4 at
every position and identical argmax (on CUDA, TF32 is off: torch's default for fp32 matmuls).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

PRESETS = ["tiny-qwen3moe", "tiny-qwen2moe", "tiny-olmoe", "tiny-mixtral", "tiny-llama"]
MAX_LOGSOFTMAX_DIFF = 1e-4   # fp32 vs fp32, same weights


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("preset", PRESETS)
def test_logits_match_transformers(tmp_path, preset, device):
    from transformers import AutoModelForCausalLM

    from localmoe.io.loader import open_model
    from localmoe.backends.registry import get_backend
    from localmoe.testing.synthetic import write_hf

    # several shards + index for one family, a single file for the others
    shard = "200KB" if preset == "tiny-qwen2moe" else None
    d = write_hf(tmp_path / preset, preset, seed=1, max_shard_size=shard)
    mf = open_model(d)
    assert mf.format == "safetensors"
    runner = get_backend("torch").load(mf, n_ctx=128, kv_spec="f32", device=device, max_seqs=2)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(3, runner.spec.vocab_size, (48,), generator=g).tolist()
    ours = runner.forward([(runner.new_sequence(), toks)], all_logits=True)[0]

    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].float()
    assert ours.shape == ref.shape
    diff = (torch.log_softmax(ours, -1) - torch.log_softmax(ref, -1)).abs().max().item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{preset} [{device}]: max|dlogsoftmax|={diff:.2e} top1={agree:.3f}")
    assert diff <= MAX_LOGSOFTMAX_DIFF
    assert agree == 1.0
    # decoding two more tokens through the cache stays on the HF logits too
    sid = runner.new_sequence()
    runner.forward([(sid, toks[:-2])])
    step = torch.stack([runner.forward([(sid, [t])])[0] for t in toks[-2:]])
    d2 = (torch.log_softmax(step, -1) - torch.log_softmax(ref[-2:], -1)).abs().max().item()
    assert d2 <= MAX_LOGSOFTMAX_DIFF
