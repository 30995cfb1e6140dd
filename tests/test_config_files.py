"""--config=FILE, --dry_run and the shipped configs/: the CPU default is train.Config's default, and
the official preset holds the released reference script's values (each listed with its source)."""

import contextlib
import dataclasses
import json
import os
import subprocess
import sys

import pytest

import config
import train
from config import apply_config_file, resolve_settings
from train import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = os.path.join(ROOT, "configs", "p2o_official.yaml")
SCRIPT = "my_scripts/deepmath_qwen3_4B_in_distribution_ref_model_reference_replace_hard_clip_0.01-10.sh"

# The released DeepMath script of zlkqz/P2O (6fc4858) and the verl defaults it runs with, as our
# settings: name -> (value, where the reference sets it). Written from the reference, not from the file.
OFFICIAL = {
    "model": ("Qwen/Qwen3-4B", f"{SCRIPT}:10 MODEL_PATH"),
    "prompts_per_step": (128, f"{SCRIPT}:25 data.train_batch_size=128"),
    "max_tokens": (12288, f"{SCRIPT}:28 data.max_response_length=12288"),
    "lr": (1e-6, f"{SCRIPT}:35 actor.optim.lr=1e-6"),
    "warmup_steps": (19, f"{SCRIPT}:36 lr_warmup_steps_ratio=0.05: int(0.05 x (39 batches x 10 epochs + 9)), "
                         "the trainer's total_training_steps (drop_last)"),
    "warmup_from_zero": (True, "verl/utils/torch_functional.py get_constant_schedule_with_warmup: s / warmup"),
    "kl_beta": (0.0, f"{SCRIPT}:37,51 use_kl_loss=false, kl_loss_coef=0.0"),
    "mini_batches": (2, f"{SCRIPT}:38 ppo_mini_batch_size=64 of train_batch_size 128"),
    "gradient_checkpointing": (True, f"{SCRIPT}:33 enable_gradient_checkpointing=true"),
    "group_size": (6, f"{SCRIPT}:54 rollout.n=6"),
    "temperature": (0.6, f"{SCRIPT}:55 rollout.temperature=0.6"),
    "save_every": (30, f"{SCRIPT}:65 trainer.save_freq=30"),
    "eval_every": (30, f"{SCRIPT}:66 trainer.test_freq=30"),
    "epochs": (10, f"{SCRIPT}:67 trainer.total_epochs=10"),
    "tau": (2, f"{SCRIPT}:69 gepa.add_near_hard=True: 0 or 1 successes are hard"),
    "gepa_auto": ("heavy_4", f"{SCRIPT}:70 gepa.auto=heavy_4"),
    "gepa_dev_max": (300, f"{SCRIPT}:71 gepa.dev_ratio=300"),
    "gepa_parents": (16, f"{SCRIPT}:72 gepa.gepa_select_pareto_k=16"),
    "crm": (True, f"{SCRIPT}:73,76 replace_prompts_when_log_prob=false, enable_template_ratio_mask=true"),
    "fix_importance_ratio": (False, f"{SCRIPT}:74 gepa.fix_importance_ratio=false"),
    "crm_low": (0.01, f"{SCRIPT}:77 template_ratio_cliprange_low=0.99 -> 1 - 0.99"),
    "crm_high": (10.0, f"{SCRIPT}:78 template_ratio_cliprange_high=9 -> 1 + 9"),
    "crm_soft": (False, f"{SCRIPT}:79 gepa.soft_clip=false"),
    "reflector": ("init", f"{SCRIPT}:17-18,75 a reflection server of Qwen3-4B itself (the starting model)"),
    "gepa_min_hard": (100, "trainer _init_gepa_cfg hard_set_min_count=100"),
    "gepa_minibatch": (3, "trainer _init_gepa_cfg reflection_minibatch_size=3"),
    "reflect_max_tokens": (2048, "trainer _init_gepa_cfg reflection_max_tokens=2048"),
    "reflect_temperature": (0.6, "trainer: reflection_temperature None -> rollout.temperature"),
    "reflect_top_p": (0.95, "utils/openaihandler.py:90-96 sends no top_p: vllm serve applies Qwen3-4B's "
                            "generation_config, top_p 0.95"),
    "reflect_top_k": (20, "the same: Qwen3-4B's generation_config top_k 20"),
    "reflect_chat_template_kwargs": ('{"enable_thinking": false}', f"{SCRIPT}:83 thinking_in_reflection=false (the "
                                     "script's intent; its client's field most likely never reached the template)"),
    "reflect_prompt": ("official", "trainer _build_reflection_prompt: GEPA's instruction-proposal prompt"),
    "reflect_guards": (False, "trainer: a non-empty extracted proposal is evaluated as it is"),
    "gepa_selection": ("official", "trainer _select_pareto_candidate_idx and the parent loop"),
    "gepa_accounting": ("official", "trainer: budget charged from iteration 2, child minibatches free"),
    "reward": ("official", "verl/utils/reward_score/deepmath.py reward_func: one \\boxed, OMI math_equal or math-verify"),
    "eps_low": (0.2, "verl actor.yaml clip_ratio_low=0.2"),
    "eps_high": (0.2, "verl actor.yaml clip_ratio_high=0.2"),
    "dual_clip": (3.0, "verl actor.yaml clip_ratio_c=3.0"),
    "weight_decay": (0.01, "verl actor.yaml optim.weight_decay=0.01"),
    "grad_clip": (1.0, "verl dp_actor.yaml grad_clip=1.0"),
    "loss_agg": ("token-mean", "verl actor.yaml loss_agg_mode=token-mean"),
    "eval_k": (0, "verl validation is greedy (val_kwargs.do_sample=False)"),
    "chat_template_kwargs": ('{"enable_thinking": false}', "verl data config enable_thinking: False (legacy_data.yaml:4), "
                             "set on every chat template by verl/utils/tokenizer.py:58-60"),
    "adv_norm": ("group", f"{SCRIPT}:22 adv_estimator=grpo; norm_adv_by_std_in_grpo defaults to True"),
    "ppo_epochs": (1, "verl actor.yaml ppo_epochs=1"),
    "top_p": (1.0, "verl rollout.yaml top_p=1"),
    "tis_cap": (0.0, "no importance correction against the rollout engine in the reference trainer"),
    "adam_beta1": (0.9, "verl fsdp_workers.py AdamW betas default (0.9, 0.999)"),
    "adam_beta2": (0.999, "verl fsdp_workers.py AdamW betas default (0.9, 0.999)"),
    "adam_eps": (1e-8, "torch.optim.AdamW's default eps (verl passes none)"),
    "crm_denominator": ("all", "core_algos agg_loss token-mean: masked tokens stay in the denominator"),
    "context_distill": (True, "trainer _rebuild_batch_input: templated rollouts trained under the plain prompt"),
    "same_template_per_group": (False, "trainer _init_gepa_cfg same_template_in_sample=False"),
    "bare_rollout": (False, "trainer _init_gepa_cfg left_1_no_template_rollout=False"),
    "drop_failed_templated": (False, "trainer _init_gepa_cfg drop_failed_template_rollout=False"),
    "prompt_format": ("official", "the released data's prompt: problem + \\boxed instruction"),
    "dev_holdout": (500, f"{SCRIPT}:24 a 500-problem validation file (here held out of the train data)"),
}


def test_the_cpu_default_config_is_train_configs_default():
    cfg = apply_config_file(Config(), os.path.join(ROOT, "configs", "cpu_default.yaml"))
    assert dataclasses.asdict(cfg) == dataclasses.asdict(Config())


def test_the_official_preset_holds_the_released_scripts_values():
    cfg = apply_config_file(Config(), PRESET)
    wrong = {k: (getattr(cfg, k), v, src) for k, (v, src) in OFFICIAL.items() if getattr(cfg, k) != v}
    assert not wrong, wrong
    assert type(cfg.lr) is float and type(cfg.crm_high) is float  # YAML's ints and 1.0e-6 became floats
    config.check_config(cfg)  # a valid configuration (the model is not looked up)


# CLIPO's release (Qwen-Applications/CLIPO, 13c5fd6), its GSM8K script and the defaults it runs with,
# as our settings on top of Config's: name -> (value, where the release sets it). From the release.
CLIPO_SCRIPT = "scripts/train_gsm8k.sh"
CLIPO = {
    "algo": ("grpo", "verl's GRPO with CLIPO's reward"),
    "clipo_weight": (0.2, f"{CLIPO_SCRIPT}:29 con_lm_head_lambda=0.2"),
    "clipo_cap": (0.5, "verl/trainer/ppo/ray_trainer.py:1669 clamp(min=-0.5)"),
    "clipo_dim": (512, f"{CLIPO_SCRIPT}:26 con_lm_head_output_size=512"),
    "clipo_tau": (0.05, f"{CLIPO_SCRIPT}:28 con_lm_head_temperature=0.05"),
    "clipo_lr": (1e-3, "verl/trainer/config/model/hf_model.yaml:55"),
    "clipo_weight_decay": (0.01, "verl/trainer/config/model/hf_model.yaml:56"),
    "clipo_loss": ("released", "ray_trainer.py:201-213 the shift and the 1e-8"),
    "frozen_steps": (13, f"{CLIPO_SCRIPT}:43 critic_warmup=14: the actor first updates at global step 14"),
    "group_size": (16, f"{CLIPO_SCRIPT}:35 rollout.n=16"),
    "prompts_per_step": (512, f"{CLIPO_SCRIPT}:32 train_batch_size=512"),
    "epochs": (6, f"{CLIPO_SCRIPT}:46 total_epochs=6"),
    "lr": (1e-6, f"{CLIPO_SCRIPT}:67 actor.optim.lr=1e-6"),
    "kl_beta": (0.001, f"{CLIPO_SCRIPT}:20-21,73 kl_loss_coef=0.001, low_var_kl"),
}


def test_the_clipo_preset_holds_the_released_values_and_nothing_else():
    cfg = apply_config_file(Config(), os.path.join(ROOT, "configs", "clipo_official.yaml"))
    differ = {k: v for k, v in dataclasses.asdict(cfg).items() if v != getattr(Config(), k)}
    assert differ == {k: v for k, (v, _) in CLIPO.items() if v != getattr(Config(), k)}
    assert all(getattr(cfg, k) == v for k, (v, _) in CLIPO.items())
    config.check_config(cfg)


# The objectives' published recipes (issue 53): name -> (value, source), written from the papers.
GSPO = {"algo": ("grpo", "a GRPO-family objective"), "policy_loss": ("gspo", "arXiv:2507.18071 eq. 5-7"),
        "eps_low": (3e-4, "§5.1"), "eps_high": (4e-4, "§5.1"), "loss_agg": ("seq-mean-token-mean", "eq. 5"),
        "mini_batches": (4, "§5.1 four minibatches"), "kl_beta": (0.0, "eq. 5")}
CISPO = {"algo": ("grpo", "§3.1"), "policy_loss": ("cispo", "arXiv:2506.13585 eq. 4"),
         "eps_low": (1.0, "§3.1 no lower bound"), "eps_high": (3.0, "ScaleRL's cap of 4"),
         "loss_agg": ("token-mean", "eq. 4"), "kl_beta": (0.0, "§3.1")}


@pytest.mark.parametrize("name, values", [("gspo", GSPO), ("cispo", CISPO)])
def test_the_objective_presets_hold_the_papers_values_and_nothing_else(name, values):
    cfg = apply_config_file(Config(), os.path.join(ROOT, "configs", f"{name}.yaml"))
    differ = {k: v for k, v in dataclasses.asdict(cfg).items() if v != getattr(Config(), k)}
    assert differ == {k: v for k, (v, _) in values.items() if v != getattr(Config(), k)}
    config.check_config(cfg)
    with pytest.raises(SystemExit) if name == "gspo" else contextlib.nullcontext():  # GSPO with P²O's CRM: refused
        config.check_config(dataclasses.replace(cfg, algo="p2o"))


def test_the_one_gpu_lora_preset_is_the_official_recipe_with_lora():
    official = dataclasses.asdict(apply_config_file(Config(), PRESET))
    cfg = apply_config_file(Config(), os.path.join(ROOT, "configs", "p2o_lora_1gpu.yaml"))
    differ = {k: v for k, v in dataclasses.asdict(cfg).items() if v != official[k]}
    assert differ == {"lora_rank": 32, "gpu_memory_utilization": 0.55}  # alpha 32, all-linear, dropout 0, x10: defaults
    assert (cfg.lora_alpha, cfg.lora_targets, cfg.lora_dropout, cfg.lora_lr_scale) == (32, "all-linear", 0.0, 10.0)
    assert train.learning_rate(cfg) == pytest.approx(1e-5)  # LoRA Without Regret's LoRA lr against full's 1e-6
    config.check_config(cfg)


def test_flags_override_the_file_wherever_it_stands_and_both_count_as_given():
    cfg, given, dry = resolve_settings(Config(), ["--lr=3e-6", f"--config={PRESET}", "--group_size", "12"])
    assert (cfg.lr, cfg.group_size, cfg.prompts_per_step, dry) == (3e-6, 12, 128, False)
    assert {"lr", "group_size", "prompts_per_step", "reward"} <= given  # on resume these win over the checkpoint
    assert "seed" not in given


def test_a_config_files_values_are_read_by_type(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-6\nwarmup_steps: 3\ncrm_high: 5\ncrm: false\nchat_template_kwargs: {enable_thinking: false}\n")
    cfg = apply_config_file(Config(), str(path))
    assert (cfg.lr, cfg.warmup_steps, cfg.crm_high, cfg.crm) == (1e-6, 3, 5.0, False)  # YAML reads 1e-6 as text
    assert json.loads(cfg.chat_template_kwargs) == {"enable_thinking": False}
    (tmp_path / "c.json").write_text(json.dumps({"group_size": 4, "reward": "official"}))
    cfg = apply_config_file(Config(), str(tmp_path / "c.json"))
    assert (cfg.group_size, cfg.reward) == (4, "official")


@pytest.mark.parametrize("text, name, message", [
    ("group_sise: 4\n", "c.yaml", "unknown setting --group_sise; did you mean --group_size?"),
    ("group_size: 4.5\n", "c.yaml", "group_size expects a int, got 4.5"),
    ("crm: maybe\n", "c.yaml", ": --crm expects a bool, got 'maybe'"),
    ("lr: [1, 2]\n", "c.yaml", "lr expects a float"),
    ("- lr\n", "c.yaml", "must hold a mapping of settings"),
    ("lr: [1\n", "c.yaml", "is not valid YAML"),
    ("{\"lr\": }", "c.json", "is not valid JSON"),
])
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, text, name, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        resolve_settings(Config(), [f"--config={path}"])
    assert message in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SystemExit, match="cannot read"):
        resolve_settings(Config(), [f"--config={tmp_path / 'missing.yaml'}"])


def test_config_is_one_file_and_an_empty_file_sets_nothing(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    assert dataclasses.asdict(resolve_settings(Config(), [f"--config={empty}"])[0]) == dataclasses.asdict(Config())
    for argv in ([f"--config={empty}", f"--config={PRESET}"], ["--config="], ["--config"]):
        with pytest.raises(SystemExit, match="--config takes one file"):
            resolve_settings(Config(), argv)


def test_dry_run_prints_the_resolved_settings_and_loads_nothing(tmp_path, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("--dry_run looked up or loaded a model")

    monkeypatch.setattr(train, "check_models", no_loading)
    monkeypatch.setattr(train, "train", no_loading)
    train.main([f"--config={PRESET}", "--lr=2e-6", "--dry_run"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["lr"] == 2e-6 and printed["reward"] == "official" and printed["max_tokens"] == 12288
    assert set(printed) == {f.name for f in dataclasses.fields(Config)}
    path = tmp_path / "resolved.json"  # what --dry_run prints is a config file
    path.write_text(json.dumps(printed))
    assert dataclasses.asdict(resolve_settings(Config(), [f"--config={path}"])[0]) == printed
    with pytest.raises(SystemExit, match="--reward is one of"):  # the settings are checked
        train.main([f"--config={PRESET}", "--reward=theirs", "--dry_run"])


def test_dry_run_from_the_command_line_is_one_json_document():
    out = subprocess.run([sys.executable, "train.py", "--config=configs/p2o_official.yaml", "--dry_run"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["gepa_auto"] == "heavy_4"
