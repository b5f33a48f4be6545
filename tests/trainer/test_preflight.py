"""``preflight(config)``: every check that can run before a model loads, the same for the CLI and Python callers."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reinforge.cli import main
from reinforge.config import ConfigError, load_config
from reinforge.controller import ResourcePool, RolePlacement
from reinforge.trainer.placement import ROLES
from reinforge.trainer.preflight import check_devices
from reinforge.trainer.rl_trainer import RLTrainer

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("overrides", [
    {"algorithm.adv_estimator": "grpoo"},  # a name checked against the estimators' registry
    {"rollout.n": 1},  # a rule the estimator's registration brings (grpo compares samples of one prompt)
    {"trainer.loggers": "[jsonl,wandbb]"},  # a tracking backend's name
    {"trainer.devices_per_node": 2},  # the local backend against the devices
    {"actor.optim.schedule": "wsd"},  # an engine schedule's name
    {"reward.custom_function": "no_such_scorer.py"},  # the scorer, imported before any model
    {"data.train_files": "[no_such_file.parquet]"},  # the data
    {"critic.model_path": "./no_such_critic", "critic.enable": True},  # the critic's folder, checked before the actor's
    {"trainer.backend": "ray", "trainer.devices_per_node": 3},  # 4 prompts x 4 samples do not split over 3 members
    {"actor.router_aux_loss_coef": 0.01},  # a load-balancing loss on a model without experts, read from its config
    {"rollout.stop_token_ids": "[99999]"},  # a stop id past the model's embedding rows: never written, never stops
], ids=lambda overrides: next(iter(overrides)))
def test_a_python_caller_gets_the_refusal_of_the_cli(rl_args, tmp_path, capsys, overrides):
    args = rl_args(tmp_path / "cli", **overrides)
    assert main(["train", *args]) == 2
    cli_line = capsys.readouterr().err.strip()
    assert cli_line.startswith("error: ") and "\n" not in cli_line

    config = load_config(None, rl_args(tmp_path / "python", **overrides))  # loads: the mistake is not the schema's
    with pytest.raises((ConfigError, ValueError, OSError)) as refusal:
        RLTrainer(config)
    assert "error: " + " ".join(str(refusal.value).split()) == cli_line.replace(str(tmp_path / "cli"),
                                                                               str(tmp_path / "python"))
    assert not (tmp_path / "python").exists() and not (tmp_path / "cli").exists()  # refused before the run folder


def test_lengths_past_a_learned_position_table_are_refused_by_train_and_plan_before_the_model_loads(
        rl_args, tmp_path, capsys):
    """GPT-2's 64 positions are rows of a table: 64 prompt + 8 response tokens failed at the first generate with an
    IndexError (whose message blamed the engine); train and plan now refuse them in the same line."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from reinforge.models import build_char_tokenizer, save_hf_folder

    tokenizer = build_char_tokenizer(())
    config = AutoConfig.for_model("gpt2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, n_embd=16,
                                  n_layer=1, n_head=2, n_positions=64)
    folder = save_hf_folder(AutoModelForCausalLM.from_config(config), tokenizer, tmp_path / "gpt2")
    refusal = (f"error: data.max_prompt_length + data.max_response_length = 72 tokens, more than the 64 positions of "
               f"the model at {folder} (n_positions in its config.json), whose position embedding is a learned table "
               "(transformer.wpe: 64 rows) with no row past them; lower data.max_prompt_length + "
               "data.max_response_length to 64 or fewer")
    args = rl_args(tmp_path / "run", **{"model.path": folder})
    capsys.readouterr()  # the save's progress bar
    assert main(["train", *args]) == 2
    assert capsys.readouterr().err.strip() == refusal
    assert main(["plan", *args, "trainer.device=cpu"]) == 2
    assert capsys.readouterr().err.strip() == refusal
    assert not (tmp_path / "run").exists()
    # a critic of its own that numbers positions so scores the same sequences: refused as well
    critic = rl_args(tmp_path / "run", **{"critic.enable": True, "critic.model_path": folder,
                                          "algorithm.adv_estimator": "gae"})
    assert main(["train", *critic]) == 2
    assert capsys.readouterr().err.strip() == refusal
    assert not (tmp_path / "run").exists()


def test_a_critic_whose_weights_do_not_fit_its_config_is_refused_before_the_actor_loads(rl_args, tiny_model_dir,
                                                                                         tmp_path, capsys):
    """critic.model_path's weights of other shapes than its config.json builds failed once the actor had loaded."""
    import json
    import shutil

    folder = tmp_path / "critic"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    args = rl_args(tmp_path / "run", **{"critic.enable": True, "critic.model_path": folder,
                                        "algorithm.adv_estimator": "gae"})
    assert main(["train", *args]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"error: critic.model_path={folder}: its weights do not fit its config.json (") \
        and "\n" not in line
    assert not (tmp_path / "run").exists()
    assert main(["plan", *args, "trainer.device=cpu"]) == 2  # which read the critic's sizes from that config.json
    assert capsys.readouterr().err.strip() == line


def test_a_critic_that_reads_the_policys_ids_otherwise_is_refused_before_a_model_loads(rl_args, tiny_model_dir,
                                                                                        tmp_path, capsys):
    """The critic reads the policy's token ids: another tokenizer's ids gave silently wrong values, an embedding of
    fewer rows an IndexError in compute_values after the first rollout."""
    import json

    from tests.model_folder_variants import with_fewer_rows, with_swapped_tokens

    swapped = with_swapped_tokens(tiny_model_dir, tmp_path / "swapped")
    fewer = with_fewer_rows(tiny_model_dir, tmp_path / "fewer")
    config = json.loads((tiny_model_dir / "config.json").read_text())
    expected = {swapped: f"error: critic.model_path={swapped}: the critic reads the policy's token ids, but 2 of the "
                         f"policy's {config['vocab_size']} tokens (first 'a') have another id or none in its "
                         "tokenizer; point it at a model of the policy's tokenizer, or unset it to start the critic "
                         "from model.path",
                fewer: f"error: critic.model_path={fewer}: the critic reads the policy's token ids, "
                       f"{config['vocab_size']} of them, but its embedding has 100 rows (vocab_size in its "
                       "config.json); point it at a model of the policy's vocabulary, or unset it to start the critic "
                       "from model.path"}
    for folder, line in expected.items():
        args = rl_args(tmp_path / "run", **{"critic.enable": True, "critic.model_path": folder,
                                            "algorithm.adv_estimator": "gae"})
        assert main(["train", *args]) == 2
        assert capsys.readouterr().err.strip() == line
        assert not (tmp_path / "run").exists()
    from reinforge.trainer.preflight import preflight

    # the policy's own model as the critic reads the ids the policy does, whatever model.tokenizer_path gives them
    preflight(load_config(None, rl_args(tmp_path / "run", **{
        "critic.enable": True, "critic.model_path": tiny_model_dir, "model.tokenizer_path": swapped,
        "algorithm.adv_estimator": "gae"})))


def test_adapters_on_no_layer_are_refused_before_the_memory_plan_is_logged(rl_args, tmp_path, capsys, caplog):
    """The plan's table (whose model line put the adapters on the default projections) came before the refusal."""
    import logging

    args = rl_args(tmp_path / "run", **{"model.lora.rank": 4, "model.lora.target_modules": "[nope]"})
    with caplog.at_level(logging.INFO):
        assert main(["train", *args]) == 2
    assert "names no linear layer" in capsys.readouterr().err and "memory plan" not in caplog.text


def test_a_critic_warmup_as_long_as_the_run_is_said_to_leave_the_actor_untrained(rl_args, tmp_path, caplog):
    from reinforge.trainer.preflight import preflight

    args = rl_args(tmp_path / "run", **{"algorithm.adv_estimator": "gae", "critic.warmup_steps": 2})
    preflight(load_config(None, args))
    assert "critic.warmup_steps=2 trains the critic alone for that many steps, and the run has 2 " \
           "(trainer.total_steps): its actor never updates" in caplog.text
    caplog.clear()
    preflight(load_config(None, [*args, "critic.warmup_steps=1"]))
    assert "critic.warmup_steps" not in caplog.text


def test_several_launched_processes_are_refused_before_the_run_folder(rl_args, tmp_path, monkeypatch):
    """Under torchrun each process would run a whole controller; the second found the run folder locked by the first."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^an RL run's controller runs in one process and starts its workers itself, "
                                          r"but WORLD_SIZE=2: .*; start it as one process, with trainer.backend=ray"):
        RLTrainer(load_config(None, rl_args(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


def test_a_placement_larger_than_one_device_is_refused_on_the_local_backend():
    pool = ResourcePool("global", [2])
    with pytest.raises(ConfigError, match=r"^trainer.backend=local runs every role in this process on one device, "
                                          r"but the resource pools ask for \{'global': 2\} devices; set trainer.backend=ray$"):
        check_devices(load_config(None, []), RolePlacement.colocated(ROLES, pool))
    check_devices(load_config(None, ["trainer.backend=ray"]), RolePlacement.colocated(ROLES, pool))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_a_gpu_is_refused_before_loading():
    config = load_config(None, ["trainer.device=cuda"])  # a config for a GPU machine loads anywhere
    with pytest.raises(ConfigError, match="trainer.device=cuda but this machine has no visible CUDA device"):
        check_devices(config)
    check_devices(load_config(None, ["trainer.device=cuda", "trainer.backend=ray"]))  # Ray's members have the GPUs


@pytest.mark.parametrize("command, key", [("train", "unknown.key"), ("train", "actor_rollout_ref.actor.optim.lr"),
                                          ("train", "actor.optim.learning_rate"), ("sft", "optim.learning_rate"),
                                          ("plan", "unknown.key")])
def test_an_unknown_key_is_refused_before_torch_is_imported(command, key):
    """A typo is answered in a fraction of a second: the key checks (verl's table included) import no torch."""
    script = ("import sys\nfrom reinforge.cli import main\n"
              f"code = main(['{command}', '{key}=1'])\n"
              "print(code, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.stdout.split() == ["2", "False"], result.stderr
    assert result.stderr.startswith(f"error: unknown key {key} (command line); ")


def image_text_config(model_type: str, vocab_size: int):
    """A tiny config of an image-text family reinforge does not train on images (its text model: 1 layer)."""
    from transformers import AutoConfig

    from reinforge.models.tiny import tiny_config

    text_family = {"gemma3": "gemma3_text", "llava": "llama"}[model_type]
    text = tiny_config(text_family, vocab_size=vocab_size, num_layers=1).to_dict()
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                 patch_size=14)
    if model_type == "gemma3":
        return AutoConfig.for_model("gemma3", text_config=text, vision_config=tower, mm_tokens_per_image=4,
                                    image_token_index=vocab_size - 1, boi_token_index=vocab_size - 3,
                                    eoi_token_index=vocab_size - 2, architectures=["Gemma3ForConditionalGeneration"])
    return AutoConfig.for_model("llava", text_config=text, image_token_index=vocab_size - 1,
                                vision_config={"model_type": "clip_vision_model", **tower},
                                architectures=["LlavaForConditionalGeneration"])


def model_folder_of(model_type: str, tiny_model_dir, tmp_path):
    """The tiny text model's folder for qwen2, else a config-only folder of an image-text ``model_type`` beside its
    tokenizer."""
    from reinforge.models import load_tokenizer

    if model_type == "qwen2":
        return tiny_model_dir
    tokenizer = load_tokenizer(tiny_model_dir)
    image_text_config(model_type, len(tokenizer) + 3).save_pretrained(tmp_path / model_type)
    tokenizer.save_pretrained(tmp_path / model_type)
    return tmp_path / model_type


@pytest.mark.parametrize("model_type, why", [
    ("gemma3", "is a Gemma3ForConditionalGeneration: its image tokens attend to each other both ways in transformers' "
               "forward (its token_type_ids mask), which reinforge's causal packed passes do not reproduce; it trains "
               "on text-only prompts (drop that column)"),
    ("llava", "is a LlavaForConditionalGeneration, whose images reinforge does not place in its language model; it "
              "trains on text-only prompts (drop that column)"),
    ("qwen2", "is a text-only model (Qwen2ForCausalLM); drop that column"),
], ids=("gemma3", "llava", "text"))
def test_rows_with_images_for_a_model_that_takes_none_are_refused_naming_the_model(rl_args, tiny_model_dir, tmp_path,
                                                                                   capsys, model_type, why):
    """A vision-language family whose images reinforge does not train (Gemma 3's image tokens attend both ways in its
    language model, which the causal packed passes would silently get wrong), and a text model: one line before any
    model loads, naming the row, the model, why and the fix, for RL and SFT rows alike."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image


    model_dir = model_folder_of(model_type, tiny_model_dir, tmp_path)
    picture = io.BytesIO()
    Image.new("RGB", (28, 28), (200, 10, 10)).save(picture, format="PNG")
    images = [{"bytes": picture.getvalue(), "path": None}]
    data = tmp_path / "images.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "arithmetic", "prompt": [
        {"role": "user", "content": "<image>How many?"}], "images": images, "reward_model": {"ground_truth": "1"},
        "messages": [{"role": "user", "content": "<image>How many?"}, {"role": "assistant", "content": "1"}]}]), data)
    expected = f"error: row 0 of {data} has 1 image(s) in its 'images' column, but {model_dir} {why}"
    assert main(["train", *rl_args(tmp_path / "run", **{"model.path": model_dir, "data.train_files": f"[{data}]"})]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(expected) and "\n" not in line
    assert main(["sft", f"model.path={model_dir}", f"data.train_files=[{data}]",
                 f"trainer.output_dir={tmp_path / 'sft'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(expected)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model_type, model", [
    ("gemma3", "a Gemma3ForConditionalGeneration, which reinforge trains on text-only prompts"),
    ("llava", "a LlavaForConditionalGeneration, which reinforge trains on text-only prompts"),
    ("qwen2", "a text-only model (Qwen2ForCausalLM)"),
], ids=("gemma3", "llava", "text"))
def test_pixel_bounds_for_a_model_given_no_processor_are_refused_naming_the_model(rl_args, tiny_model_dir, tmp_path,
                                                                                  capsys, model_type, model):
    """data.min_pixels and data.max_pixels resize only the images of the vision-language models reinforge gives a
    processor: set for a text model or an image-text model trained on text (Gemma 3's and Llava's image processors
    resize to a fixed size, with no pixel bound), they would do nothing; one line, before any model loads."""
    import pyarrow as pa
    import pyarrow.parquet as pq


    model_dir = model_folder_of(model_type, tiny_model_dir, tmp_path)
    data = tmp_path / "text.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "arithmetic", "prompt": [{"role": "user", "content": "1+1?"}],
                                          "reward_model": {"ground_truth": "2"}, "messages": [
        {"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}] * 4), data)
    for bounds, given in ((["data.max_pixels=200704"], "data.max_pixels=200704 bounds"),
                          (["data.min_pixels=3136", "data.max_pixels=200704"],
                           "data.min_pixels=3136 and data.max_pixels=200704 bound")):
        unset = " and ".join(bound.split("=")[0] for bound in bounds)
        expected = (f"error: {given} the images of Qwen2-VL, Qwen2.5-VL and Qwen3-VL, and {model_dir} is {model}: no "
                    f"image of the run is resized by {'it' if len(bounds) == 1 else 'them'}; unset {unset}")
        assert main(["train", *rl_args(tmp_path / "run", **{"model.path": model_dir, "data.train_files": f"[{data}]"}),
                     *bounds]) == 2
        assert capsys.readouterr().err.strip() == expected
        assert main(["sft", f"model.path={model_dir}", f"data.train_files=[{data}]",
                     f"trainer.output_dir={tmp_path / 'sft'}", *bounds]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == expected
    assert not (tmp_path / "run").exists() and not (tmp_path / "sft").exists()


def test_a_reward_function_ray_cannot_send_is_refused_before_any_model_loads(rl_args, tmp_path):
    pytest.importorskip("ray")
    import threading

    lock = threading.Lock()

    def shared_counter(completions, **kwargs):
        with lock:
            return [1.0] * len(completions)

    config = load_config(None, rl_args(tmp_path / "run", **{"trainer.backend": "ray"}))
    with pytest.raises(ValueError, match=r"^reward_functions\[0\] \(shared_counter\) cannot be sent to the Ray members "
                                         r"\(TypeError: cannot pickle '_thread.lock' object\); create what it holds"):
        RLTrainer(config, reward_functions=[shared_counter])
    assert not (tmp_path / "run").exists()


ALL_MEMORY_SETTINGS = {"actor.max_tokens_per_micro_batch": 4096, "model.gradient_checkpointing": False,
                       "actor.logits_buffer_gib": 1.0, "rollout.kv_cache_gib": 0.1, "rollout.free_cache_engine": True,
                       "actor.optimizer_offload": False, "actor.param_offload": False, "ref.param_offload": False,
                       "actor.keep_gathered": False}


@pytest.mark.parametrize("settings", [{}, ALL_MEMORY_SETTINGS], ids=("planned", "all-given"))
@pytest.mark.parametrize("window", [0, -5])
def test_a_model_config_that_cannot_build_is_refused_before_the_run_folder(rl_args, tiny_model_dir, tmp_path, settings,
                                                                           window):
    """A window of -5 or 0 failed only as the model built, also where no memory setting is auto (no plan is made)."""
    import json
    import shutil

    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "model")
    config_file = model_dir / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {
        "use_sliding_window": True, "max_window_layers": 0, "sliding_window": window}))
    config = load_config(None, rl_args(tmp_path / "run", **{"model.path": model_dir, **settings}))
    with pytest.raises(ValueError, match=rf"^{config_file} gives sliding_window={window}, which is no window; "):
        RLTrainer(config)
    assert not (tmp_path / "run").exists()


def test_a_router_aux_loss_coef_on_a_model_without_experts_is_refused_naming_the_model(tiny_model_dir, tmp_path):
    """TRL refuses a coefficient on a model that is not a mixture of experts; 0, null and declared stay fine, as does
    a coefficient on a mixture of experts whose config does not ask for the loss."""
    from reinforge.config.schema import ModelConfig
    from reinforge.models.tiny import save_tiny_model
    from reinforge.trainer.preflight import check_router_aux_loss_has_experts

    dense = ModelConfig(path=str(tiny_model_dir))
    with pytest.raises(ConfigError, match=r"^actor.router_aux_loss_coef=0.01 weighs a mixture of experts' load-balancing "
                                          r"loss, but model.path=.* is a 'qwen2' model without experts, which has no "
                                          r"router to balance; remove actor.router_aux_loss_coef or set it to 0$"):
        check_router_aux_loss_has_experts("actor.router_aux_loss_coef", 0.01, dense)
    for value in (0.0, None, "declared"):
        check_router_aux_loss_has_experts("actor.router_aux_loss_coef", value, dense)
    experts = ModelConfig(path=str(save_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_layers=1)))
    check_router_aux_loss_has_experts("actor.router_aux_loss_coef", 0.01, experts)


def test_a_disk_that_cannot_hold_one_checkpoint_is_refused_before_the_model_loads(rl_args, tmp_path, monkeypatch):
    """A run on a nearly full disk trained every step and failed at its first checkpoint."""
    import shutil
    from collections import namedtuple

    from reinforge.trainer import preflight as preflight_module

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 24_000, 24_000))
    config = load_config(None, rl_args(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^trainer.output_dir=.*run: its disk has 24.0 KB free, and a checkpoint "
                                          r"\(every run writes one, at least at its end\) holds the model's weights, "
                                          r"about .* or more .*; free space there, or set trainer.output_dir to a "
                                          r"folder on a disk with room$"):
        RLTrainer(config)
    assert not (tmp_path / "run").exists()
    lora = load_config(None, rl_args(tmp_path / "run", **{"model.lora.rank": 8}))  # its hf/ holds the merged model
    with pytest.raises(ConfigError, match=r"^trainer.output_dir=.*run: its disk has 24.0 KB free"):
        RLTrainer(lora)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 10**12))
    preflight_module.check_checkpoint_room(config.model.path, str(tmp_path / "run" / "a" / "b"))


def test_a_resumed_run_whose_prompt_file_changed_is_refused_before_any_model_loads(rl_args, arithmetic_data_dir,
                                                                                   tmp_path, monkeypatch):
    """Rows added to data.train_files since the checkpoint: the loader's refusal came once every role's model had
    loaded, at fit(); SFT, RM and DPO refuse it before."""
    import pyarrow.parquet as pq

    data = tmp_path / "train.parquet"
    table = pq.read_table(arithmetic_data_dir / "train.parquet")
    pq.write_table(table, data)
    args = rl_args(tmp_path / "run", **{"data.train_files": f"[{data}]", "trainer.total_steps": 1})
    assert main(["train", *args]) == 0
    pq.write_table(table.slice(0, table.num_rows - 4), data)  # four prompts fewer
    from reinforge.trainer import rl_trainer

    def no_model(*args, **kwargs):
        raise AssertionError("a model loaded")

    monkeypatch.setattr(rl_trainer.ActorRolloutWorker, "__init__", no_model)
    config = load_config(None, [*args, "trainer.total_steps=2"])
    with pytest.raises(ValueError, match=rf"^the checkpoint's data loader had num_prompts={table.num_rows} but this run "
                                         rf"has {table.num_rows - 4}; .*start a new run$"):
        RLTrainer(config)


def test_an_fp8_cache_on_a_gpu_without_fp8_kernels_is_refused_before_the_model_loads(rl_args, tmp_path, monkeypatch):
    """Triton compiles float8 e4m3 from compute capability 8.9 on: on an A100 the native engine's fp8 kernels failed
    to compile at the first rollout; preflight and the engine refuse it in one line, and a Hopper passes."""
    from reinforge.rollout.native.kv_quant import fp8_device_refusal, fp8_refusal
    from reinforge.trainer.preflight import check_fp8_kv_cache_device

    capability = [(8, 0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    config = load_config(None, rl_args(tmp_path, **{"rollout.name": "native", "rollout.kv_cache_dtype": "fp8",
                                                    "trainer.device": "auto"}))
    with pytest.raises(ConfigError, match=r"^rollout.kv_cache_dtype=fp8: the native engine's fp8 kernels need a GPU of "
                                          r"compute capability 8.9 or newer \(Ada, Hopper\), and this NVIDIA "
                                          r"A100-SXM4-80GB is 8.0; use rollout.kv_cache_dtype=auto$"):
        check_fp8_kv_cache_device(config)
    config.rollout.kv_cache_dtype = "auto"
    check_fp8_kv_cache_device(config)
    config.rollout.kv_cache_dtype = "fp8"
    capability[0] = (9, 0)
    check_fp8_kv_cache_device(config)
    assert fp8_device_refusal(torch.device("cpu")) is None  # the PyTorch path keeps an fp8 cache anywhere
    capability[0] = (8, 6)
    assert "this NVIDIA A100-SXM4-80GB is 8.6" in fp8_refusal("qwen2", False, torch.device("cuda", 0), use_triton=True)
    assert fp8_refusal("qwen2", False, torch.device("cuda", 0), use_triton=False) is None
