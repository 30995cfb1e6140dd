"""rollout.py: vLLM and HF backends (prompt ids, EOS, stop strings, log-probs within 1e-3) and the verified weight push."""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from prompts import build_messages
from prompts import encode_prompt
from rollout import HFRollout, WeightPushError

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


def test_one_call_mixes_greedy_and_sampled_prompts(vllm_engine, hf_model):
    """Per-prompt temperatures (scoring.answer_sets' single call): the greedy prompts of a mixed call
    answer exactly as in a greedy-only call, the sampled ones get their n samples; both backends."""
    hf = HFRollout(None, model=hf_model, tokenizer=vllm_engine.tokenizer, batch_size=2)
    for engine in (vllm_engine, hf):
        alone = engine.generate(PROMPTS, n=1, temperature=0.0, max_tokens=16)
        mixed = engine.generate(PROMPTS + PROMPTS, n=[3] * len(PROMPTS) + [1] * len(PROMPTS),
                                temperature=[1.0] * len(PROMPTS) + [0.0] * len(PROMPTS), max_tokens=16, seed=1)
        assert [len(g) for g in mixed] == [3] * len(PROMPTS) + [1] * len(PROMPTS)
        assert [g[0].response_ids for g in mixed[len(PROMPTS):]] == [g[0].response_ids for g in alone]
        assert len({tuple(s.response_ids) for g in mixed[:len(PROMPTS)] for s in g}) > len(PROMPTS)  # sampled
    with pytest.raises(ValueError, match="2 values for 3 prompts"):
        hf.generate(PROMPTS[:3], temperature=[0.0, 1.0])


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

    from prompts import encode_prompt

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and "
                         "not enable_thinking %}<think></think>{% endif %}{% endif %}")
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    plain = tok.decode(encode_prompt(tok, msgs))
    off = tok.decode(encode_prompt(tok, msgs, {"enable_thinking": False}))
    assert plain == "<user>What is 2 + 2?<assistant>" and off == plain + "<think></think>"


# ---- the CUDA path's calls, on the CPU: a stand-in for vllm.LLM that records what VLLMRollout asks of it


class StandInLLM:
    """The calls VLLMRollout makes on vllm.LLM, recorded in `calls`, with an HF model as the
    worker's model: reload_weights copies each (name, tensor) into it as vLLM's loader does,
    one at a time as it comes out of the iterator (a name it does not have is recorded as a
    warning, as vLLM logs one); collective_rpc(function) runs the function on a worker holding
    it. `corrupt`: a loader that stores a wrong value for that parameter."""

    def __init__(self, model, tokenizer, corrupt=None):
        self.model, self.tokenizer, self.corrupt, self.calls = model, tokenizer, corrupt, []
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16, hf_config=model.config,
                                                                       max_model_len=512))
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: model))

    def get_tokenizer(self):
        return self.tokenizer

    def sleep(self, level):
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({','.join(tags)})")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return self.reset_ok

    reset_ok = True

    @torch.no_grad()
    def collective_rpc(self, method, kwargs=None):
        if callable(method):
            return [method(self.worker)]
        assert method == "reload_weights"
        self.calls.append("reload_weights")
        params = dict(self.model.named_parameters())
        for name, tensor in kwargs["weights_iterator"]:
            self.calls.append(f"load {name}")
            if name not in params:
                self.calls.append(f"warning: no parameter {name}")
                continue
            params[name].copy_(tensor + (1e-2 if name == self.corrupt else 0.0))
        return [None]

    def generate(self, prompts, params, use_tqdm=False):
        self.params = params
        out = SimpleNamespace(token_ids=[2], text="", finish_reason="stop", logprobs=None)
        return [SimpleNamespace(outputs=[out] * p.n) for p in params]


def cuda_engine(tiny_model, sleep_level=1, rank=0, corrupt=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout import VLLMRollout

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    llm = StandInLLM(model, AutoTokenizer.from_pretrained(tiny_model), corrupt)
    return VLLMRollout(tiny_model, sleep_level=sleep_level, rank=rank, llm=llm, cpu=False)


def perturbed_weights(tiny_model, scale=0.05):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return policy


def test_cuda_push_wakes_weights_streams_then_wakes_the_kv_cache(tiny_model):
    """TRL's and verl's order: wake the weights only, stream each tensor in as it is produced
    (never collected first), reset the prefix cache, then wake the KV cache. The tied LM head
    is not sent (vLLM would warn on every push), and the engine ends up with the pushed bf16
    values (checksum-verified)."""
    import dist

    engine = cuda_engine(tiny_model)
    assert engine.tied_embeddings and engine.dtype == torch.bfloat16
    policy = perturbed_weights(tiny_model)
    produced = []

    def stream():
        for name, tensor in dist.full_parameters(policy, engine.dtype):
            produced.append(name)
            engine.llm.calls.append(f"produce {name}")
            yield name, tensor

    engine.sleep()
    report = engine.push_weights(stream())
    names = [n for n, _ in policy.named_parameters()]
    calls = engine.llm.calls
    expected = ["sleep(1)", "wake_up(weights)", "reload_weights"]
    expected += [c for n in names for c in (f"produce {n}", f"load {n}")]  # one at a time
    expected += ["reset_prefix_cache", "wake_up(kv_cache)"]
    assert calls == expected
    assert report == {"pushed": len(names), "verified": len(names)}
    for (name, want), got in zip(policy.named_parameters(), engine.llm.model.parameters()):
        assert torch.equal(got, want.detach().to(torch.bfloat16)), name
    calls.clear()
    engine.push_weights(policy.state_dict())  # a state dict holds lm_head.weight too: not sent when tied
    assert "load lm_head.weight" not in calls and not [c for c in calls if c.startswith("warning")]
    assert calls[0] == "reload_weights" and calls[-1] == "reset_prefix_cache"  # awake: nothing to wake


def test_cuda_push_that_loaded_a_wrong_value_raises(tiny_model):
    from rollout import WeightPushError

    engine = cuda_engine(tiny_model, corrupt="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(WeightPushError, match="model.layers.1.mlp.up_proj.weight does not hold the pushed values"):
        engine.push_weights(perturbed_weights(tiny_model).state_dict())


def test_a_prefix_cache_that_could_not_be_emptied_fails_the_push(tiny_model):
    from rollout import WeightPushError

    engine = cuda_engine(tiny_model)
    engine.llm.reset_ok = False
    with pytest.raises(WeightPushError, match="prefix cache"):
        engine.push_weights(perturbed_weights(tiny_model).state_dict())


def test_pushes_log_no_warning_for_layers_no_checkpoint_holds(vllm_engine, hf_model):
    """vLLM's reload warns "<Layer>: Failed to load weights" for the tied LM head and the rotary
    embedding on every push (measured on vLLM-CPU 0.32: two lines a push). Those are filtered;
    another layer's warning still gets through."""
    import logging

    from rollout import RELOAD_LOGGER

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(RELOAD_LOGGER)
    logger.addHandler(handler)
    try:
        vllm_engine.push_weights(hf_model.state_dict())
        assert vllm_engine.tied_embeddings and seen == []
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")
        assert seen == ["QKVParallelLinear: Failed to load weights"]
    finally:
        logger.removeHandler(handler)


def test_cuda_sleep_level_two_and_waking_for_generation(tiny_model):
    engine = cuda_engine(tiny_model, sleep_level=2)
    engine.sleep()
    engine.sleep()  # asleep already: no second call
    engine.generate(["hello"], n=1, max_tokens=4)
    assert engine.llm.calls == ["sleep(2)", "wake_up(kv_cache,weights)"]


def test_cuda_requests_carry_their_own_seeds(tiny_model):
    """Seeds on CUDA: request i gets base + (samples of the requests before it), vLLM adds the
    child index (seed + j), base = request_seed_base(call seed, rank): equal calls get equal
    seeds, the other rank and the next call other ones; unseeded calls stay unseeded."""
    from rollout import request_seed_base

    seeds = {}
    for rank in (0, 1):
        engine = cuda_engine(tiny_model, rank=rank)
        for seed in (7, 8):
            engine.generate(["a", "b", "c"], n=[2, 3, 1], seed=seed)
            seeds[rank, seed] = [p.seed for p in engine.llm.params]
            base = request_seed_base(seed, rank)
            assert seeds[rank, seed] == [base, base + 2, base + 5]
        engine.generate(["a", "b", "c"], n=[2, 3, 1], seed=7)
        assert [p.seed for p in engine.llm.params] == seeds[rank, 7]
        engine.generate(["a"], n=4)
        assert engine.llm.params[0].seed is None
    assert seeds[0, 7] != seeds[1, 7] and seeds[0, 7] != seeds[0, 8]
    engine.generate(["a", "b"], n=[2, 1], temperature=[0.6, 0.0], seed=7)  # per-prompt temperatures
    assert [(p.n, p.temperature) for p in engine.llm.params] == [(2, 0.6), (1, 0.0)]


def test_request_seed_ranges_of_different_calls_do_not_overlap():
    """The seeds of a call are base .. base + samples - 1. Over 2,000 calls (consecutive step
    seeds on 4 ranks, 64 samples each) no two calls share a seed: bases are 48-bit hashes, not
    seed + rank, which would make call s + 1 reuse call s's seeds."""
    from rollout import request_seed_base

    bases = sorted(request_seed_base(seed, rank) for seed in range(500) for rank in range(4))
    assert len(set(bases)) == 2000 and all(b < 2 ** 48 for b in bases)
    assert min(b - a for a, b in zip(bases, bases[1:])) >= 64


def test_seeded_calls_differ_between_ranks_and_reproduce_under_torchrun(tmp_path, model_path):
    """Two torchrun ranks, each with its own vLLM-CPU engine, make the same seeded call twice:
    each rank's two calls agree, and the ranks' samples for the same prompts differ (one
    process's seed + rank seeds the CPU generator; on CUDA, per-request seeds, tested above)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(root, "tests", "rollout_dist_child.py"), model_path, str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for first, second in ranks:
        assert first == second  # a repeated seeded call reproduces
    assert all(len(set(map(tuple, group))) > 1 for group in ranks[0][0])  # sampled, not greedy
    for p in range(2):
        assert ranks[0][0][p] != ranks[1][0][p]  # the same prompt, the same call seed: other samples


def test_hf_push_copies_every_parameter_and_persistent_buffers(tiny_model):
    """HFRollout.push_weights: a state dict's persistent buffers are loaded too, a missing
    parameter or an unknown name is an error."""
    engine = HFRollout(tiny_model)
    engine.model.register_buffer("scale", torch.zeros(3))  # a persistent buffer, as some models have
    source = perturbed_weights(tiny_model)
    source.register_buffer("scale", torch.arange(3.0))
    engine.push_weights(source.state_dict())
    assert torch.equal(engine.model.scale, torch.arange(3.0))
    for (name, a), b in zip(source.named_parameters(), engine.model.parameters()):
        assert torch.equal(a, b), name
    state = source.state_dict()
    with pytest.raises(WeightPushError, match="not pushed"):
        engine.push_weights({k: v for k, v in state.items() if "layers.0.mlp" not in k})
    with pytest.raises(WeightPushError, match="no parameter model.bogus"):
        engine.push_weights({**state, "model.bogus": torch.zeros(1)})


def test_a_request_that_cannot_fit_the_context_is_an_error_not_a_short_answer(tiny_model, vllm_engine):
    from prompts import encode_prompt
    from rollout import ContextError

    engine = cuda_engine(tiny_model)
    prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    length = len(encode_prompt(engine.tokenizer, prompt))
    engine.generate([prompt], max_tokens=512 - length)  # exactly the context: fine
    with pytest.raises(ContextError, match=f"a prompt of {length} tokens \\+ max_tokens={513 - length} does not fit "
                                           "the engine's context of 512 tokens"):
        engine.generate([prompt, [{"role": "user", "content": "Hi"}]], max_tokens=513 - length)
    assert vllm_engine.max_model_len == 1024  # the real engine reports the context it was built with
    with pytest.raises(ContextError):
        vllm_engine.generate([prompt], max_tokens=1024)


def test_prepared_weights_push_as_a_state_dict_does_and_are_verified_with_their_own_sums(vllm_engine, hf_model):
    """Self-Ref pushes the same two weight sets for every reflection: PreparedWeights casts and sums
    them once. A push of them leaves the engine answering exactly as a push of the state dict; the
    sums they carry are those of the cast tensors, and they are what the engine is checked
    against: a prepared tensor changed after its sum was taken fails the push."""
    from rollout import PreparedWeights, checksum

    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    gen = torch.Generator().manual_seed(5)
    perturbed = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    prepared = PreparedWeights(lambda: iter(perturbed.items()), vllm_engine.dtype)
    assert [n for n, _ in prepared] == list(perturbed)
    emb = "model.embed_tokens.weight"
    assert prepared.sums[emb] == checksum([perturbed[emb].to(vllm_engine.dtype)], vllm_engine.dtype)
    try:
        vllm_engine.push_weights(perturbed)
        want = vllm_engine.generate(PROMPTS, n=1, temperature=0, max_tokens=16, logprobs=True)
        vllm_engine.push_weights(original)
        assert vllm_engine.push_weights(prepared)["verified"] > 0
        got = vllm_engine.generate(PROMPTS, n=1, temperature=0, max_tokens=16, logprobs=True)
        assert [(g[0].response_ids, g[0].logprobs) for g in got] == [(g[0].response_ids, g[0].logprobs) for g in want]
        dict(prepared.tensors)[emb][0, 0] += 1.0  # the cached sum no longer describes what is pushed
        with pytest.raises(WeightPushError, match=f"{emb} does not hold the pushed values"):
            vllm_engine.push_weights(prepared)
    finally:
        vllm_engine.push_weights(original)


def test_self_ref_prepares_both_weight_sets_once_in_the_engine_dtype(tiny_model):
    import train
    from rollout import PreparedWeights, make_reflector

    policy = perturbed_weights(tiny_model).state_dict()
    engine = SimpleNamespace(dtype=torch.bfloat16)
    reflector = make_reflector(train.Config(reflector="init"), engine, tiny_model, policy, Counter())
    for prepared in (reflector.swap, reflector.restore):
        assert isinstance(prepared, PreparedWeights) and {t.dtype for _, t in prepared} == {torch.bfloat16}
    assert torch.equal(dict(reflector.restore.tensors)["model.norm.weight"], policy["model.norm.weight"].bfloat16())
    assert not torch.equal(dict(reflector.swap.tensors)["model.norm.weight"], policy["model.norm.weight"].bfloat16())


def test_a_vocabulary_padded_by_the_engine_is_checked_on_its_own_rows():
    """vLLM pads an embedding to a multiple of 64 rows and zeroes the padding: the engine's checksum
    covers the org_vocab_size rows a push sends (else every push of such a model raised on the
    count). Padding that is not zero keeps the whole parameter in the sum, and the count differs."""
    from rollout import _engine_checksums, checksum

    embed = torch.nn.Embedding(64, 4)
    embed.org_vocab_size = 50
    with torch.no_grad():
        embed.weight[50:] = 0
    model = torch.nn.ModuleDict({"embed": embed})
    worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: model))
    sums, _ = _engine_checksums(worker)
    assert sums["embed.weight"] == checksum([embed.weight[:50]], embed.weight.dtype)
    with torch.no_grad():
        embed.weight[60, 1] = 1.0
    sums, _ = _engine_checksums(worker)
    assert sums["embed.weight"][0] == 64 * 4
