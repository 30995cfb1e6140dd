"""The reflector's own sampling and chat template (--reflect_top_p, --reflect_top_k,
--reflect_chat_template_kwargs): checked by config.py, carried by rollout.make_reflector to
EngineReflector and into both engines' generate, and counted by rollout.context_length.
(The server reflector's request body: tests/test_reflector.py.)"""

from collections import Counter
from dataclasses import replace

import pytest

import train
from config import check_config, parse_overrides, reflector_chat_kwargs
from rollout import context_length
from data import Problem
from rollout import EngineReflector, HFRollout, Sample

# a chat template that shows whether enable_thinking=False reached it (Qwen3 adds an empty thought)
THINK_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and "
                  "not enable_thinking %}<think></think>{% endif %}{% endif %}")
USER = [{"role": "user", "content": "Hi"}]


# ----------------------------------------------------------------------------- config.py


@pytest.mark.parametrize("flag, message", [
    ("--reflect_top_p=0", "--reflect_top_p must be > 0, got 0.0"),
    ("--reflect_top_p=1.5", "--reflect_top_p must be <= 1, got 1.5"),
    ("--reflect_top_k=-1", "--reflect_top_k must be >= 0, got -1"),
    ("--reflect_chat_template_kwargs=[1]", "--reflect_chat_template_kwargs must be a JSON object, got '[1]'"),
    ("--reflect_chat_template_kwargs={bad", "--reflect_chat_template_kwargs must be a JSON object, got '{bad'"),
])
def test_bad_reflector_settings_are_one_line(flag, message):
    cfg = parse_overrides(train.Config(), [flag])
    with pytest.raises(SystemExit) as e:
        check_config(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_reflector_chat_kwargs():
    cfg = parse_overrides(train.Config(), ["--reflect_top_p=0.95", "--reflect_top_k=20",
                                           '--reflect_chat_template_kwargs={"enable_thinking": true}'])
    check_config(cfg)
    assert reflector_chat_kwargs(cfg) == {"enable_thinking": True}
    assert reflector_chat_kwargs(train.Config()) is None  # '': the engine's own
    assert reflector_chat_kwargs(train.Config(reflect_chat_template_kwargs="{}")) == {}


def test_context_length_encodes_the_reflection_prompt_with_the_reflectors_template(model_path):
    """Official framing (no prefill: the template's generation prompt is added, and with it
    enable_thinking's empty thought). The reflector's arguments, when given, win over the policy's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.chat_template = THINK_TEMPLATE
    problems = [Problem("a", "What is 2 + 2?", "4")]
    cfg = train.Config(reflect_prompt="official")
    plain = context_length(cfg, tok, problems, {})
    off = context_length(replace(cfg, reflect_chat_template_kwargs='{"enable_thinking": false}'), tok, problems, {})
    assert off > plain
    assert context_length(cfg, tok, problems, {"enable_thinking": False}) == off  # '': the policy's arguments
    on = replace(cfg, reflect_chat_template_kwargs='{"enable_thinking": true}')
    assert context_length(on, tok, problems, {"enable_thinking": False}) == plain


@pytest.mark.parametrize("fmt", ["default", "official"])
def test_context_length_covers_a_real_official_reflection_prompt(model_path, fmt):
    """The official prompt shows whole user messages and answers cut start + end: in tokens, any
    such call on the data fits the context with its reply."""
    from transformers import AutoTokenizer

    from gepa import reflection_prompt
    from prompts import encode_prompt

    tok = AutoTokenizer.from_pretrained(model_path)
    problems = [Problem("a", "What is 2 + 2?", "4"), Problem("b", "What is " + " + ".join(["7"] * 30) + "?", "210")]
    cfg = train.Config(reflect_prompt="official", prompt_format=fmt, max_tokens=16, max_template_chars=40,
                       reflect_answer_chars=120, reflect_max_tokens=30, gepa_minibatch=2)
    need = context_length(cfg, tok, problems, {})
    for answers in (["x9 " * 100, "\\boxed{1}\\boxed{2}" * 20], ["", "7 + " * 60 + "\\boxed{210}"]):
        text = reflection_prompt(cfg, "t" * 40, problems, answers, [0.0, 1.0])
        assert len(encode_prompt(tok, [{"role": "user", "content": text}])) + 30 <= need


# ----------------------------------------------------------------------------- reflectors


class RecordingEngine:
    """Records each generate call's keyword arguments; answers every prompt with one finished text."""
    def __init__(self):
        self.calls = []

    def generate(self, prompts, **kw):
        self.calls.append(kw)
        return [[Sample([1], [2], "```\nA\n```", "stop")] for _ in prompts]


def test_engine_reflector_sends_its_sampling_and_chat_template_settings():
    engine = RecordingEngine()
    EngineReflector(engine).reflect(["p"])
    assert {k: engine.calls[-1][k] for k in ("top_p", "top_k", "chat_template_kwargs")} == \
        {"top_p": 1.0, "top_k": 0, "chat_template_kwargs": None}  # the defaults: no cut, the engine's template
    EngineReflector(engine, top_p=0.95, top_k=20, chat_template_kwargs={"enable_thinking": True}).reflect(["p"])
    assert {k: engine.calls[-1][k] for k in ("top_p", "top_k", "chat_template_kwargs")} == \
        {"top_p": 0.95, "top_k": 20, "chat_template_kwargs": {"enable_thinking": True}}


def test_make_reflector_carries_the_reflector_settings():
    engine = RecordingEngine()
    cfg = train.Config(reflector="policy", reflect_prompt="official", reflect_temperature=0.6, reflect_top_p=0.95,
                       reflect_top_k=20, reflect_chat_template_kwargs='{"enable_thinking": true}')
    assert train.make_reflector(cfg, engine, None, None, Counter()).reflect(["p"]) == [("```\nA\n```", True)]
    kw = engine.calls[-1]
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["chat_template_kwargs"]) == \
        (0.6, 0.95, 20, {"enable_thinking": True})
    train.make_reflector(train.Config(reflector="policy"), engine, None, None, Counter()).reflect(["p"])
    assert (engine.calls[-1]["top_p"], engine.calls[-1]["top_k"], engine.calls[-1]["chat_template_kwargs"]) == \
        (1.0, 0, None)


# ----------------------------------------------------------------------------- the engines' generate


def hf_engine(tiny_model, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = THINK_TEMPLATE
    return HFRollout(None, model=AutoModelForCausalLM.from_pretrained(tiny_model), tokenizer=tok, **kwargs)


def test_hf_top_k_one_samples_the_greedy_answer(tiny_model):
    engine = hf_engine(tiny_model)
    prompt = ["The capital of France is"]
    greedy = engine.generate(prompt, temperature=0, max_tokens=12)[0][0].response_ids
    cut = engine.generate(prompt, n=4, temperature=1.5, top_k=1, max_tokens=12, seed=0)[0]
    assert all(s.response_ids == greedy for s in cut)  # top-1 of any temperature is the argmax
    free = engine.generate(prompt, n=4, temperature=1.5, max_tokens=12, seed=0)[0]
    assert any(s.response_ids != greedy for s in free)  # top_k 0: no cut, the samples stray


def test_a_calls_chat_template_kwargs_replace_the_engines_hf(tiny_model):
    engine = hf_engine(tiny_model, chat_template_kwargs={"enable_thinking": False})
    decode = engine.tokenizer.decode
    own = engine.generate([USER], temperature=0, max_tokens=1)[0][0]
    assert decode(own.prompt_ids) == "<user>Hi<assistant><think></think>"
    call = engine.generate([USER], temperature=0, max_tokens=1, chat_template_kwargs={"enable_thinking": True})[0][0]
    assert decode(call.prompt_ids) == "<user>Hi<assistant>"


def test_vllm_generate_passes_top_k_and_a_calls_chat_template_kwargs(tiny_model):
    from test_rollout import cuda_engine  # a stand-in for vllm.LLM that records the SamplingParams

    engine = cuda_engine(tiny_model)
    engine.tokenizer.chat_template = THINK_TEMPLATE
    engine.chat_template_kwargs = {"enable_thinking": False}
    decode = engine.tokenizer.decode
    out = engine.generate([USER], temperature=0.6, top_p=0.95, top_k=20, max_tokens=4)
    assert (engine.llm.params[0].top_k, engine.llm.params[0].top_p) == (20, 0.95)
    assert decode(out[0][0].prompt_ids) == "<user>Hi<assistant><think></think>"
    out = engine.generate([USER], temperature=0.6, max_tokens=4, chat_template_kwargs={"enable_thinking": True})
    assert engine.llm.params[0].top_k == 0  # the default: off (vLLM's 0)
    assert decode(out[0][0].prompt_ids) == "<user>Hi<assistant>"


def test_vllm_top_k_one_samples_the_greedy_answer(vllm_engine):
    """The real engine (vLLM 0.32's SamplingParams: top_k 0 is off, k keeps the k most likely)."""
    prompt = ["The capital of France is"]
    greedy = vllm_engine.generate(prompt, temperature=0, max_tokens=8)[0][0].response_ids
    cut = vllm_engine.generate(prompt, n=3, temperature=1.5, top_k=1, max_tokens=8, seed=0)[0]
    assert all(s.response_ids == greedy for s in cut)
    free = vllm_engine.generate(prompt, n=3, temperature=1.5, max_tokens=8, seed=0)[0]
    assert any(s.response_ids != greedy for s in free)
