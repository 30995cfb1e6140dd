"""rollout.py: vLLM and HF backends (prompt ids, EOS, stop strings, log-probs within 1e-3) and the verified weight push."""

import pytest
import torch

from prompts import build_messages
from rollout import HFRollout, WeightPushError, encode_prompt

PROMPTS = [build_messages("What is 3 + 4?", fewshot=True),
           build_messages("What is 12 + 45?", fewshot=True),
           "The capital of France is"]


def reference_logprobs(model, sample, temperature=1.0):
    """Teacher-forced log-probs of the sampled tokens from the HF model, fp32."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature  # [T, V]
    start = len(sample.prompt_ids)
    logp = logits[start - 1:-1].log_softmax(-1)  # [R, V]: position t predicts token t+1
    return logp.gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_vllm_logprobs_match_hf_on_the_same_sequences(vllm_engine, hf_model, temperature):
    groups = vllm_engine.generate(PROMPTS, n=3, temperature=temperature, max_tokens=32,
                                  logprobs=True, seed=1)
    worst = 0.0
    for group in groups:
        assert len(group) == 3
        for s in group:
            assert len(s.logprobs) == len(s.response_ids) > 0
            ref = reference_logprobs(hf_model, s, temperature)
            worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    assert worst <= 1e-3


def test_prompt_encoding_and_sample_fields(vllm_engine):
    tok = vllm_engine.tokenizer
    chat = encode_prompt(tok, PROMPTS[0])
    assert tok.decode(chat).endswith("<|im_start|>assistant\n")
    assert encode_prompt(tok, "hello world") == tok("hello world").input_ids
    stop, = vllm_engine.generate([PROMPTS[0]], n=1, temperature=0, max_tokens=64)[0]
    assert stop.finish_reason == "stop" and stop.response_ids[-1] == tok.eos_token_id  # EOS kept
    assert stop.prompt_ids == chat and "\\boxed{7}" in stop.text
    cut, = vllm_engine.generate([PROMPTS[0]], n=1, temperature=0, max_tokens=3)[0]
    assert cut.finish_reason == "length" and cut.response_ids == stop.response_ids[:3]


def test_hf_backend_matches_vllm_greedy(vllm_engine, hf_model):
    hf = HFRollout(None, model=hf_model, tokenizer=vllm_engine.tokenizer, batch_size=2)
    got = hf.generate(PROMPTS, n=2, temperature=0, max_tokens=24, logprobs=True)
    want = vllm_engine.generate(PROMPTS, n=1, temperature=0, max_tokens=24, logprobs=True)
    for g, w in zip(got, want):
        assert len(g) == 2
        for s in g:
            assert s.prompt_ids == w[0].prompt_ids
            assert s.response_ids == w[0].response_ids
            assert s.finish_reason == w[0].finish_reason
            assert max(abs(a - b) for a, b in zip(s.logprobs, w[0].logprobs)) <= 1e-3
    sampled = hf.generate(PROMPTS[:1], n=4, temperature=1.0, max_tokens=8, seed=0)[0]
    assert all(len(s.response_ids) <= 8 for s in sampled)
    assert hf.generate(PROMPTS[:1], n=4, temperature=1.0, max_tokens=8, seed=0)[0] == sampled


def test_push_changes_outputs_and_restores_them_exactly(vllm_engine, hf_model):
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    before = vllm_engine.generate(PROMPTS, n=1, temperature=0, max_tokens=24, logprobs=True)
    gen = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    try:
        report = vllm_engine.push_weights(perturbed)
        assert report["verified"] > 0
        during = vllm_engine.generate(PROMPTS, n=1, temperature=0, max_tokens=24, logprobs=True)
        assert any(a[0].response_ids != b[0].response_ids or a[0].logprobs != b[0].logprobs
                   for a, b in zip(before, during))
    finally:
        vllm_engine.push_weights(original)
    after = vllm_engine.generate(PROMPTS, n=1, temperature=0, max_tokens=24, logprobs=True)
    for a, b in zip(before, after):
        assert a[0].response_ids == b[0].response_ids
        assert a[0].logprobs == b[0].logprobs  # bit-exact


def test_engine_computes_with_every_pushed_weight(vllm_engine, hf_model):
    """After a push the engine's log-probs equal HF's for the SAME new weights. Only the
    embedding changes here: with tied embeddings it is also the LM head, which vLLM-CPU
    keeps as a separate packed copy that must be refreshed."""
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    changed = dict(original)
    emb = "model.embed_tokens.weight"
    changed[emb] = original[emb] * (1 + 0.5 * torch.rand(original[emb].shape, generator=gen))
    changed["lm_head.weight"] = changed[emb]  # tied: the state dict holds it under both names
    try:
        vllm_engine.push_weights(changed)
        hf_model.load_state_dict(changed, strict=False)
        hf_model.tie_weights()
        groups = vllm_engine.generate(PROMPTS, n=2, temperature=1.0, max_tokens=16, logprobs=True, seed=2)
        worst = max((reference_logprobs(hf_model, s) - torch.tensor(s.logprobs)).abs().max().item()
                    for g in groups for s in g)
        assert worst <= 1e-3
    finally:
        hf_model.load_state_dict(original, strict=False)
        hf_model.tie_weights()
        vllm_engine.push_weights(original)


def test_incomplete_or_silently_dropped_push_raises(vllm_engine, hf_model, monkeypatch):
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    shifted = {k: v + 0.01 for k, v in original.items()}
    try:
        with pytest.raises(WeightPushError, match="not in the pushed state dict"):
            vllm_engine.push_weights({k: v for k, v in shifted.items() if "layers.3." not in k})
        real_rpc = vllm_engine.llm.collective_rpc

        def dropping_rpc(method, *args, **kwargs):  # a loader that ignores what it is given
            return None if method == "reload_weights" else real_rpc(method, *args, **kwargs)

        monkeypatch.setattr(vllm_engine.llm, "collective_rpc", dropping_rpc)
        with pytest.raises(WeightPushError, match="does not hold the pushed values"):
            vllm_engine.push_weights(shifted)
    finally:
        monkeypatch.undo()
        vllm_engine.push_weights(original)


def test_seeded_vllm_calls_are_reproducible(vllm_engine):
    from data import load_jsonl

    prompts = [build_messages(p.problem, fewshot=True) for p in load_jsonl("builtin-train")[0][:24]]
    ids = lambda groups: [s.response_ids for g in groups for s in g]  # noqa: E731
    a = vllm_engine.generate(prompts, n=4, temperature=1.0, max_tokens=24, seed=7)
    vllm_engine.generate(prompts[::-1], n=2, temperature=1.0, max_tokens=8)  # fills the prefix cache
    b = vllm_engine.generate(prompts, n=4, temperature=1.0, max_tokens=24, seed=7)
    c = vllm_engine.generate(prompts, n=4, temperature=1.0, max_tokens=24, seed=8)
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)


def test_stop_strings_and_assistant_prefill(vllm_engine, hf_model):
    tok = vllm_engine.tokenizer
    msgs = [{"role": "user", "content": "Count from 1 to 20."}, {"role": "assistant", "content": "1, 2, 3, 4,"}]
    assert tok.decode(encode_prompt(tok, msgs)).endswith("<|im_start|>assistant\n1, 2, 3, 4,")  # no new turn
    v = vllm_engine.generate([msgs], n=1, temperature=0, max_tokens=30, stop=[","])[0][0]
    assert v.finish_reason == "stop" and v.text.endswith(",") and v.text.count(",") == 1
    assert v.text.strip() == "5,"
    h = HFRollout(None, model=hf_model, tokenizer=tok).generate([msgs], n=1, temperature=0, max_tokens=30,
                                                                  stop=[","])[0][0]
    assert (h.text, h.finish_reason) == (v.text, v.finish_reason)


def test_chat_template_kwargs_reach_the_template(model_path):
    """--chat_template_kwargs (e.g. Qwen3's enable_thinking=False) is passed to the chat template
    by encode_prompt, which both backends and the trainer use."""
    from transformers import AutoTokenizer

    from rollout import encode_prompt

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and "
                         "not enable_thinking %}<think></think>{% endif %}{% endif %}")
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    plain = tok.decode(encode_prompt(tok, msgs))
    off = tok.decode(encode_prompt(tok, msgs, {"enable_thinking": False}))
    assert plain == "<user>What is 2 + 2?<assistant>" and off == plain + "<think></think>"
