"""model.py: the shipped GGUF converted once into an atomic safetensors cache, with its chat template."""

import os

import pytest

import model
from model import atomic_directory, resolve_model


def test_atomic_directory_commits_only_complete_folders(tmp_path):
    out = tmp_path / "cache" / "m"
    with pytest.raises(KeyboardInterrupt):  # a kill half-way through the writes
        with atomic_directory(str(out)) as tmp:
            open(os.path.join(tmp, "config.json"), "w").write("{}")
            raise KeyboardInterrupt
    assert not out.exists()
    assert os.listdir(tmp_path / "cache") == []  # the partial folder was removed

    with atomic_directory(str(out)) as tmp:
        open(os.path.join(tmp, "config.json"), "w").write("{}")
    assert (out / "config.json").read_text() == "{}"

    with atomic_directory(str(out)) as tmp:  # someone else finished first: keep theirs
        open(os.path.join(tmp, "config.json"), "w").write("{\"late\": 1}")
    assert (out / "config.json").read_text() == "{}"
    assert os.listdir(tmp_path / "cache") == ["m"]


def test_resolve_model_converts_once_and_ignores_leftovers(tmp_path, monkeypatch):
    monkeypatch.setenv("P2O_CACHE", str(tmp_path))
    (tmp_path / ".partial-abc").mkdir()  # left by a killed conversion: never used
    calls = []

    def fake_convert(gguf, out_dir):
        calls.append(out_dir)
        with atomic_directory(out_dir) as tmp:
            open(os.path.join(tmp, "config.json"), "w").write("{}")

    monkeypatch.setattr(model, "convert_gguf", fake_convert)
    monkeypatch.setattr(model, "shipped_gguf_path", lambda: "x.gguf")
    first = resolve_model()
    assert first == str(tmp_path / model.CACHE_NAME) and len(calls) == 1
    assert resolve_model() == first and len(calls) == 1  # cached
    assert resolve_model("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"
    assert resolve_model("runs/x/ckpt") == "runs/x/ckpt"


def test_shipped_model_keeps_its_chat_template(model_path):
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    reader = gguf.GGUFReader(model.shipped_gguf_path())
    field = reader.fields["tokenizer.chat_template"]
    original = bytes(field.parts[field.data[0]]).decode()
    tok = AutoTokenizer.from_pretrained(model_path)
    assert tok.chat_template == original
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert AutoConfig.from_pretrained(model_path).model_type == "llama"
    assert tok.eos_token == "<|im_end|>"


def test_packed_flex_attention_casts_q_k_v_as_sdpa_does_under_autocast(monkeypatch):
    """Under bf16 autocast the rotary embedding leaves q and k in fp32 beside a bf16 v: SDPA (an autocast op)
    casts the three to bf16, flex (not one) would compute with mixed dtypes, which inductor's flex backward
    refuses on a GPU. The flex path casts as SDPA does: same dtype out, same values within bf16 rounding."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from model import packed_flex_attention

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 128, 16, generator=gen), torch.randn(1, 2, 128, 16, generator=gen)  # fp32
    v = torch.randn(1, 2, 128, 16, generator=gen).to(torch.bfloat16)
    block = create_block_mask(lambda b, h, i, j: j <= i, 1, 1, 128, 128, device="cpu")
    causal = torch.ones(128, 128, dtype=torch.bool).tril()[None, None]
    module = torch.nn.Module()
    module.is_causal = False
    seen, flex_attention = [], model._flex("cpu")
    monkeypatch.setattr(model, "_flex", lambda device: lambda *a, **kw: seen.append({t.dtype for t in a}) or
                        flex_attention(*a, **kw))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        flex, _ = packed_flex_attention(module, q, k, v, block, scaling=0.25)
        sdpa, _ = sdpa_attention_forward(module, q, k, v, causal, scaling=0.25)
    assert seen == [{torch.bfloat16}]  # what the compiled kernel gets on a GPU: one dtype
    assert flex.dtype == sdpa.dtype == torch.bfloat16
    assert (flex.float() - sdpa.float()).abs().max().item() <= 2e-2
