"""Shared fixtures. One vLLM engine (fp32, so log-probs can be compared with HF at 1e-3) and one
HF copy of the default model serve the whole test session: engine start-up costs 5-40 s. A tiny
random Llama with the same tokenizer serves the training tests."""

import os
import sys

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
def tiny_model(tmp_path_factory, model_path):
    """A tiny randomly initialised Llama with the default model's tokenizer, saved as an HF folder."""
    from model import tiny_random_model

    return tiny_random_model(model_path, str(tmp_path_factory.mktemp("tiny")), max_position_embeddings=512,
                             initializer_range=0.2)  # prompt-sensitive greedy outputs (0.02 repeats one token)
