"""Shared fixtures. One vLLM engine (fp32, so log-probs can be compared with HF at 1e-3) and one
HF copy of the default model serve the whole test session: engine start-up costs 5-40 s. A tiny
random Llama with the same tokenizer serves the training tests. Below the fixtures: the helpers
the training tests share (a tiny model's Config, scripted rewards, engines and reflectors, hand-made
rows), imported as `from conftest import ...`."""

import json
import os
import sys
import zlib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def model_path():
    from model import resolve_model

    return resolve_model()


@pytest.fixture(scope="session")
def hf_model(model_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def vllm_engine(model_path):
    from rollout import VLLMRollout

    return VLLMRollout(model_path, dtype="float32", max_model_len=1024, seed=0)


@pytest.fixture(scope="session")
def lora_engine(model_path):
    """A bf16 engine serving LoRA adapters (vLLM's LoRA, max_lora_rank 32), as a LoRA run on a GPU
    starts one: what the fp32 engine above cannot show, updates below a bf16 step, shows here."""
    from rollout import VLLMRollout

    return VLLMRollout(model_path, dtype="bfloat16", max_model_len=1024, seed=0, lora_rank=32)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, model_path):
    """A tiny randomly initialised Llama with the default model's tokenizer, saved as an HF folder."""
    from model import tiny_random_model

    return tiny_random_model(model_path, str(tmp_path_factory.mktemp("tiny")), max_position_embeddings=512,
                             initializer_range=0.2)  # prompt-sensitive greedy outputs (0.02 repeats one token)


# ----------------------------------------------------------------------------- shared helpers of the training tests
# (imported by name; train is imported lazily so that collecting a test file does not load it)


def _train():
    import train

    return train


def parity_reward(text, problem):
    """Scripted reward for a random model: mixed within groups, so advantages are non-zero."""
    return float(len(text) % 2 == 0)


def tiny_config(tiny_model, tmp_path, **over):
    cfg = _train().Config(model=tiny_model, backend="hf", prompts_per_step=3, group_size=4, max_tokens=6,
                 temperature=1.0, micro_batch_size=5, lr=1e-3, warmup_steps=1, dev_data="",
                 eval_every=0, save_every=2, max_steps=2, out_dir=str(tmp_path), run_name="t",
                 autocast_bf16=False, seed=3)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


class MarkingEngine:
    """HF rollouts on the tiny model whose texts say whether the prompt carried a GEPA template
    (the scripted templates start with 'Approach'): the tiny model cannot learn arithmetic, so
    the scripted reward below makes templates help, as P²O hopes real templates do."""

    def __init__(self, path):
        from rollout import HFRollout

        self.hf = HFRollout(path)

    def generate(self, prompts, **kw):
        groups = self.hf.generate(prompts, **kw)
        for p, g in zip(prompts, groups):
            if "Approach" in p[-1]["content"]:
                for s in g:
                    s.text += " [templated]"
        return groups

    def push_weights(self, state_dict):
        return self.hf.push_weights(state_dict)


def templated_reward(text, problem):
    """1 for about half of the templated answers, 0 for every plain one."""
    return float("[templated]" in text and zlib.crc32((problem.id + text).encode()) % 2 == 0)


def small_data(tmp_path):
    path = tmp_path / "six.jsonl"
    rows = [{"id": f"q{i}", "problem": f"What is {i} + {i + 2} × 3?", "answer": str(i + (i + 2) * 3),
             "source": "test"} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def scripted_reflector():
    n = {"i": 0}

    def reflect(prompts):
        out = []
        for p in prompts:
            assert "the correct answer is" in p  # the records carry the feedback
            n["i"] += 1
            out.append((f"Sure. <template>Approach {n['i']}: think it through.</template>", True))
        return out
    return reflect


def p2o_config(tiny_model, tmp_path, data, **over):
    settings = dict(algo="p2o", train_data=data, prompts_per_step=3, group_size=4, max_steps=0, epochs=2,
                    tau=2, gepa_min_hard=1, gepa_budget=30, gepa_parents=3, gepa_minibatch=1, save_every=0)
    return tiny_config(tiny_model, tmp_path, **{**settings, **over})


def load_tiny(path):
    from transformers import AutoModelForCausalLM

    import torch

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    return model


def full_logits_logprobs(model, ids, attention, mask, temperature):
    """Reference: the whole [B, L, V] logits, log-softmax at T, gathered at the next tokens."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].double()  # [B, L-1, V]
    logp = torch.log_softmax(logits / temperature, -1)
    lp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, L-1]
    ent = -(logp.exp() * logp).sum(-1)  # [B, L-1]
    return lp * mask, ent[mask]


def update_config(**over):
    return _train().Config(**{**dict(temperature=1.0, micro_batch_size=2, autocast_bf16=False, lr=1e-2, warmup_steps=1), **over})


def some_rows():
    Row = _train().Row
    return [Row([5, 6, 7], [9, 10, 2], 1.0), Row([8], [11, 12, 13, 2], -1.0),
            Row([5, 6], [14, 2], 0.5, tilde_prompt_ids=[30, 31, 5, 6]), Row([7, 7], [15, 16], -0.5)]
