"""The command line: help, unknown commands, and the CPU smoke mode of both benches."""

import json
import sys

import pytest

from reinforge.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"  {name}" in out


def test_the_module_docstring_and_architecture_md_name_every_command():
    from pathlib import Path

    import reinforge.cli

    opening = " ".join(reinforge.cli.__doc__.split("\n\n")[0].split())  # "... reinforge``): train, plan, ..."
    assert opening.split("): ", 1)[1].rstrip(".").split(", ") == list(COMMANDS)
    architecture = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    cli_row = next(line for line in architecture.splitlines() if line.startswith("| `cli.py`"))
    assert cli_row.split("`reinforge ", 1)[1].split("`", 1)[0].split(" / ") == list(COMMANDS)


def test_help_names_every_demo_and_every_benchmark(capsys):
    from reinforge.bench import SUBCOMMANDS

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    demo_help = capsys.readouterr().out
    assert "--agent" in demo_help and "--vision" in demo_help  # make demo-agent, make demo-vision
    bench_line = COMMANDS["bench"][1]
    assert all(name in bench_line for name in SUBCOMMANDS), bench_line


def test_unknown_command_is_refused(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


@pytest.mark.parametrize("variant", ["grpo", "ppo"])
def test_bench_train_cpu_smoke(tmp_path, variant):
    out = tmp_path / "bench.json"
    assert main(["bench", "train", "--cpu", "--steps", "2", "--variant", variant, "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["variant"] == variant and len(results["steps"]) == 2
    assert results["median"]["step_s"] > 0 and results["median"]["update_tokens"] > 0
    if sys.platform == "linux":  # resident host memory split into anonymous and file-backed pages, as the kernel counts it
        median = results["median"]
        assert 0 < median["host_rssanon_gb"] <= median["host_peak_gb"] and median["host_rssfile_gb"] >= 0


@pytest.mark.parametrize("module", ["reinforge", "reinforge.cli"])
def test_python_dash_m_prints_the_usage(module):
    import subprocess

    result = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage: reinforge <command>" in result.stdout, result.stderr
@pytest.mark.parametrize("flags", [["--variant", "kl", "--lora", "8"], ["--optimizer-offload", "true"]])
def test_bench_train_cpu_smoke_with_lora_and_optimizer_offload(tmp_path, flags):
    out = tmp_path / "bench.json"
    assert main(["bench", "train", "--cpu", "--steps", "2", *flags, "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert len(results["steps"]) == 2 and results["median"]["step_s"] > 0


@pytest.mark.parametrize("argv, usage", [
    (["train", "--from-verl", "--help"], "usage: reinforge train --from-verl"),
    (["train", "--from-verl", "data.train_files=/x.parquet", "-h"], "usage: reinforge train --from-verl"),
    (["config", "from-verl", "--help"], "usage: reinforge config from-verl"),
    (["config", "from-verl", "actor_rollout_ref.rollout.n=4", "--help"], "usage: reinforge config from-verl"),
])
def test_help_after_from_verl_prints_the_usage(argv, usage, capsys):
    assert main(argv) == 0  # it was "error: '--help' (verl command line) is not of the form key=value"
    assert capsys.readouterr().out.startswith(usage)


def test_a_folder_given_as_the_config_file_is_named_a_folder(tmp_path, capsys):
    assert main(["train", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: config file {tmp_path} is a folder; pass a YAML file such as "
                                               "examples/grpo_gsm8k.yaml")


def test_plan_refusals_are_error_lines_and_its_usage_is_its_own(capsys):
    assert main(["plan"]) == 2
    assert capsys.readouterr().err.strip() == ("error: model.path is not set; pass model.path=/path/to/hf_model "
                                               "(the planner reads its config.json)")
    with pytest.raises(SystemExit):
        main(["plan", "--gpu-memory-gib", "many"])
    assert capsys.readouterr().err.splitlines()[-1].startswith("reinforge plan: error: argument --gpu-memory-gib")


def test_plan_warns_as_train_does_where_the_native_engine_will_not_run(tmp_path, capsys, caplog):
    """With rollout.name=hf, or a model the native engine cannot run, train warns that an fp8 cache has no effect or
    that it falls back to the hf backend; plan said nothing while it counted a native engine's memory."""
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12,
                                                          n_head=12, n_positions=1024)))
    plan = ["plan", f"model.path={tmp_path}", "rollout.kv_cache_dtype=fp8", "--gpu-memory-gib", "80",
            "trainer.device=cuda"]
    assert main([*plan, "rollout.name=hf"]) == 0
    assert ("rollout.kv_cache_dtype=fp8 has no effect: they are settings of the native engine and rollout.name is hf; "
            "set rollout.name=native, or remove rollout.kv_cache_dtype") in caplog.text
    caplog.clear()
    assert main([*plan, "rollout.name=native"]) == 0
    assert ("rollout.name=native cannot run this model: GPT2LMHeadModel (model_type 'gpt2') has no entry in the "
            "architecture table") in caplog.text and "rolling out with the hf backend" in caplog.text
    assert "rollout.free_cache_engine            True       (fixed)" in capsys.readouterr().out


def test_plan_refuses_the_devices_train_refuses(capsys):
    """Several devices on the local backend, and samples that do not split over Ray's members: train refused both,
    plan said they fit."""
    plan = ["plan", "--model", "0.5b", "--gpu-memory-gib", "80", "--host-memory-gib", "100", "trainer.device=cuda"]
    assert main([*plan, "trainer.devices_per_node=2"]) == 2
    assert capsys.readouterr().err.startswith("error: trainer.backend=local runs every worker in this process on one")
    assert main([*plan, "trainer.devices_per_node=8", "trainer.backend=ray", "--prompts", "3", "--n", "3"]) == 2
    assert "9 samples do not split evenly over the 8 members" in capsys.readouterr().err


def test_plan_refuses_a_rollout_engine_train_would_not_find(capsys):
    assert main(["plan", "--model", "0.5b", "--gpu-memory-gib", "80", "rollout.name=vllm_typo"]) == 2
    assert capsys.readouterr().err.startswith("error: rollout.name='vllm_typo' is not a rollout engine; known: hf, native")


def test_plan_refuses_what_train_refuses_of_the_model_before_it_loads(capsys):
    """A router aux loss on a model without experts, and a critic for a vision-language model: plan said they fit."""
    plan = ["plan", "--gpu-memory-gib", "80", "--host-memory-gib", "200"]
    assert main([*plan, "--model", "0.5b", "actor.router_aux_loss_coef=0.01"]) == 2
    # the shape by its name, not the temporary folder its config.json was written to
    assert ("but the --model 0.5b shape is a 'qwen2' model without experts, which has no router to balance"
            in capsys.readouterr().err)
    assert main([*plan, "--model", "qwen2.5-vl-3b", "algorithm.adv_estimator=gae"]) == 2
    assert "is a vision-language model, whose critic reinforge does not build" in capsys.readouterr().err


def test_plan_refuses_a_reward_model_folder_that_is_no_classification_model(tiny_model_dir, capsys):
    """A causal LM as reward.reward_model.model_path: train refused it before any model loaded, plan said it fits."""
    assert main(["plan", "--model", "0.5b", "--gpu-memory-gib", "80", "--host-memory-gib", "100",
                 "reward.reward_model.enable=true", f"reward.reward_model.model_path={tiny_model_dir}"]) == 2
    assert "is not a classification model (Qwen2ForCausalLM in its config.json)" in capsys.readouterr().err


def test_plan_refuses_a_classification_model_as_the_policy_as_train_does(tiny_model_dir, tmp_path, capsys):
    """A reward model's folder as model.path: train refused it before any model loaded, plan said it fits."""
    folder = tmp_path / "rm"
    folder.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen2ForSequenceClassification"]}))
    assert main(["plan", f"model.path={folder}", "trainer.device=cpu", "--host-memory-gib", "100"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: model.path={folder} is Qwen2ForSequenceClassification (in its config.json), a classification model "
        "that writes no text; point it at a causal LM folder (...ForCausalLM), and give a reward model to "
        "reward.reward_model.model_path")


def test_hydras_deletion_is_named_and_a_config_path_in_home_is_found(tmp_path, monkeypatch, capsys):
    assert main(["train", "~actor.optim.lr"]) == 2  # it was "config file ~actor.optim.lr does not exist"
    assert capsys.readouterr().err.strip() == (
        "error: override '~actor.optim.lr' (command line) deletes a key in Hydra; here every key has a default: leave "
        "actor.optim.lr out to keep it, or set actor.optim.lr=... to change it")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run.yaml").write_text("actor:\n  optim:\n    lrr: 1\n")
    assert main(["train", "~/run.yaml"]) == 2  # read, not "~/run.yaml does not exist"
    assert capsys.readouterr().err.strip().startswith("error: unknown key actor.optim.lrr (from run.yaml)")


@pytest.mark.parametrize("argv, what", [
    (["train", "actor.optim.lr=1e-6", "run.yaml"], "a config file after the overrides"),
    (["sft", "base.yaml", "extra.yml"], "a second config file; a run takes one"),
    (["plan", "model.path=/m", "run.yaml"], "a config file after the overrides"),
])
def test_a_config_file_out_of_place_is_named(argv, what, capsys):
    assert main(argv) == 2  # it was "override 'run.yaml' (command line) is not of the form key=value"
    item = argv[-1]
    assert capsys.readouterr().err.strip() == (
        f"error: {item} (command line) is {what}: write reinforge {argv[0]} CONFIG.yaml a.b=c ... with the file first "
        "and settings of other files as a.b=c overrides")


@pytest.mark.parametrize("argv", [[name, "--help"] for name in COMMANDS] + [
    ["bench", "train", "--help"], ["data", "gsm8k", "--help"], ["config", "from-verl", "--help"],
    ["train", "--from-verl", "--help"], ["sandbox", "serve", "--help"], ["demo", "--agent", "--help"]])
def test_every_command_answers_help_with_its_usage(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own --help
        code = exit_.code
    assert code == 0
    assert "usage: reinforge" in capsys.readouterr().out


@pytest.mark.parametrize("argv, line", [
    (["train", "--bogus"], "reinforge train: error: unrecognized arguments: --bogus; reinforge train --help lists what "
                           "it takes"),
    (["serve", "--port", "x", "m"], "reinforge serve: error: argument --port: invalid int value: 'x'; reinforge serve "
                                    "--help lists what it takes"),
    (["plan", "--gpu-memory-gib", "many"], "reinforge plan: error: argument --gpu-memory-gib: invalid float value: "
                                           "'many'; reinforge plan --help lists what it takes"),
])
def test_a_wrong_flag_is_one_line_that_points_to_help(argv, line, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == line + "\n"  # not the usage (a dozen lines for serve) above it
    import argparse

    with pytest.raises(SystemExit):  # outside the command line, argparse is argparse's own again
        argparse.ArgumentParser(prog="other").parse_args(["--bogus"])
    assert capsys.readouterr().err.startswith("usage: other")


def test_demo_help_names_both_other_demos(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "--agent" in out and "--vision" in out  # reinforge demo --vision was in no help


@pytest.mark.parametrize("setting, traceback", [("0", False), ("false", False), ("", False), ("1", True)])
def test_reinforge_debug_0_keeps_the_one_line_errors(setting, traceback, monkeypatch, capsys):
    monkeypatch.setenv("REINFORGE_DEBUG", setting)  # "0" was a non-empty string, so it turned debugging on
    if traceback:
        with pytest.raises(Exception, match="unknown key"):
            main(["train", "actor.optim.lrr=1"])
    else:
        assert main(["train", "actor.optim.lrr=1"]) == 2
        assert capsys.readouterr().err.startswith("error: unknown key actor.optim.lrr")


def test_torchs_loggers_stay_at_warning_though_its_import_is_interrupted(caplog):
    """A Ctrl-C while torch imports (a run's first seconds) leaves its loggers unset, below the root's INFO that the
    command line sets: FakeTensor's exit hook would then print its cache statistics under the run's last line."""
    import logging

    torch_logger = logging.getLogger("torch")
    caplog.set_level(logging.INFO)
    torch_logger.setLevel(logging.NOTSET)  # as before the end of torch's import
    try:
        with pytest.raises(SystemExit):  # argparse's own --help, after the logging is set
            main(["sft", "--help"])
        assert not logging.getLogger("torch._subclasses.fake_tensor").isEnabledFor(logging.INFO)
    finally:
        torch_logger.setLevel(logging.WARNING)
