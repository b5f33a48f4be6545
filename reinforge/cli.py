"""``reinforge <command>`` (or ``python -m reinforge``): init, train, plan, sft, rm, dpo, eval, demo, export, plot, bench,
data, config, sandbox, serve.

A command parses and validates its configuration before any model, tokenizer or dataset
loads, so a typo in a key fails in seconds with one line, not after a minute of loading.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path


def _config_arguments(argv: list[str], *, prog: str, description: str, config_help: str,
                      example: str) -> tuple[str | None, list[str]]:
    """``[config.yaml] a.b=c ...`` -> (config path or None, overrides); the file may be left out."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("config", nargs="?", help=config_help)
    parser.add_argument("overrides", nargs="*", help=f"a.b=c overrides, e.g. {example}")
    args = parser.parse_args(argv)
    config, overrides = args.config, list(args.overrides)
    if config is not None and ("=" in config or (config.startswith("~") and "/" not in config)):  # ~key: Hydra's
        config, overrides = None, [config, *overrides]
    for item in overrides:
        if "=" not in item and item.endswith((".yaml", ".yml")):
            from reinforge.config import ConfigError

            where = "a second config file; a run takes one" if config else "a config file after the overrides"
            raise ConfigError(f"{item} (command line) is {where}: write {prog.split(' [')[0]} CONFIG.yaml a.b=c ... with the file "
                              "first and settings of other files as a.b=c overrides")
    return config, overrides


def _train(argv: list[str]) -> int:
    if argv and argv[0] == "--from-verl":  # verl's overrides, translated (reinforge.config.commands)
        from reinforge.config.commands import TRAIN_USAGE, asks_for_help, load_from_verl

        if asks_for_help(argv[1:]):
            print(TRAIN_USAGE)
            return 0
        from reinforge.tracking.backends import missing_backend_package

        config = load_from_verl(argv[1:], missing_backend_package, _compares_a_prompts_samples)
    else:
        config_path, overrides = _config_arguments(
            argv, prog="reinforge train", description="Run RL training (GRPO, PPO, ...); "
            "`reinforge train --from-verl KEY=VALUE ... [-- a.b=c ...]` runs a verl command line.",
            config_help="a YAML config file (only the keys that differ from defaults)",
            example="actor.optim.lr=1e-6 rollout.n=8")

        from reinforge.config import load_config

        config = load_config(config_path, overrides)  # unknown keys and the schema's own rules, before torch loads
    from reinforge.trainer.rl_trainer import RLTrainer

    RLTrainer(config).fit()  # its constructor runs trainer.preflight, as for any Python caller
    return 0


def _plan(argv: list[str]) -> int:
    """``reinforge plan [CONFIG] [a.b=c ...] [--gpu-memory-gib N] [--host-memory-gib M] [--model SHAPE]``: the plan.

    It answers for any machine: the device type comes from the config (``trainer.device``), the card's size from
    ``--gpu-memory-gib`` (else this machine's card). A run that cannot fit is refused as ``train`` refuses it.
    ``--model SHAPE`` plans a shape of ``reinforge bench train`` (its config.json, the bench's workload and the
    shape's LoRA adapter, before the command line's overrides) without any model folder. ``--prompts``, ``--n``,
    ``--prompt-tokens`` and ``--response-tokens`` set the workload as ``bench train`` names it (e.g. long
    responses: ``--prompts 8 --response-tokens 32768``). ``--image-size W[xH]`` (pixels) sets a vision-language
    model's image tokens a prompt (data.max_image_tokens) for one image of that size, as the model's processor
    resizes it (its preprocessor_config.json, within data.min_pixels and data.max_pixels); a vision-language shape's
    prompts hold one such image (448 x 448 by default, as ``bench train``'s) beside their ``--prompt-tokens``."""
    sizes = argparse.ArgumentParser(prog="reinforge plan", add_help=False)
    sizes.add_argument("--gpu-memory-gib", type=float, default=None)
    sizes.add_argument("--host-memory-gib", type=float, default=None)
    sizes.add_argument("--model", default=None)
    sizes.add_argument("--image-size", default=None)
    for flag in PLAN_WORKLOAD_FLAGS:
        sizes.add_argument(flag, type=int, default=None)
    known, rest = sizes.parse_known_args(argv)
    if known.model is not None:  # a bench shape: its config.json alone, in a folder of its own while it plans
        import shutil
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="reinforge_plan_"))
        try:
            return _plan_run(rest, known, _shape_overrides(known.model, folder), _shape_image(known))
        except ValueError as error:  # a refusal names the shape, not the folder that is gone once it is printed
            if error.args and isinstance(error.args[0], str) and str(folder) in error.args[0]:
                shape = f"the --model {known.model} shape"
                error.args = (error.args[0].replace(f"model.path={folder}", shape).replace(str(folder), shape),
                              *error.args[1:])
            raise
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return _plan_run(rest, known, [])


def _shape_names() -> list[str]:
    from reinforge.bench.shapes import SHAPES

    return list(SHAPES)


PLAN_WORKLOAD_FLAGS = {"--prompts": "data.train_batch_size", "--n": "rollout.n",
                       "--prompt-tokens": "data.max_prompt_length", "--response-tokens": "data.max_response_length"}
"""``reinforge plan``'s workload flags (those of ``reinforge bench train``) and the keys they set."""


def _shape_overrides(name: str, folder: Path) -> list[str]:
    """model.path of shape ``name``'s config.json (written into ``folder``), the bench's workload and the shape's
    training settings, as overrides that the command line's own come after."""
    from reinforge.bench.shapes import SHAPES, STANDARD_WORKLOAD, write_shape_config
    from reinforge.config import ConfigError

    if name not in SHAPES:
        raise ConfigError(f"--model {name} (command line) is no model shape; give one of {', '.join(SHAPES)}, or "
                          "model.path=FOLDER for a model of your own")
    return [f"model.path={write_shape_config(name, folder)}", *STANDARD_WORKLOAD, *SHAPES[name].config_overrides()]


def _image_side(value: str) -> tuple[int, int]:
    """(width, height) of ``--image-size`` W or WxH, in pixels."""
    from reinforge.config import ConfigError

    try:
        sides = [int(side) for side in value.lower().split("x")]
    except ValueError:
        sides = []
    if len(sides) not in (1, 2) or min(sides) < 1:
        raise ConfigError(f"--image-size {value} (command line) is no image size; give pixels a side (448) or "
                          "width x height (640x480)")
    return sides[0], sides[-1]


def _shape_image(known: argparse.Namespace) -> tuple[str, int] | None:
    """A vision-language shape's image and text a prompt: one image of ``--image-size`` (by default the bench's
    448 x 448) and ``--prompt-tokens`` of text (128 by default); None for a text shape. Consumes
    ``known.prompt_tokens`` and ``known.image_size``."""
    from reinforge.bench.shapes import SHAPES
    from reinforge.bench.vision import IMAGE_SIDE

    if not SHAPES[known.model].vision:
        return None
    image = (known.image_size or str(IMAGE_SIDE), known.prompt_tokens or 128)
    known.prompt_tokens = known.image_size = None
    return image


def _plan_run(rest: list[str], known: argparse.Namespace, shape_overrides: list[str],
              shape_image: tuple[str, int] | None = None) -> int:
    config_path, overrides = _config_arguments(
        rest, prog="reinforge plan [--gpu-memory-gib N] [--host-memory-gib M] [--model SHAPE] [--prompts P] [--n N] "
                   "[--prompt-tokens T] [--response-tokens R] [--image-size W[xH]]",
        description="Print the memory plan of a run on a card of any size, from any machine (reads only the "
        "model's config.json); exit 2 with one line if it cannot fit. --gpu-memory-gib N: a card of N GiB (default: "
        "this machine's); --host-memory-gib M: M GiB of host memory (default: this machine's); --model SHAPE: a "
        "model shape of reinforge bench train, no model folder needed (" + ", ".join(_shape_names()) + "); "
        "--prompts P, --n N, --prompt-tokens T, --response-tokens R: the workload (data.train_batch_size, rollout.n, "
        "data.max_prompt_length, data.max_response_length); --image-size W[xH]: one image of that size a prompt "
        "(vision-language models), resized as the model's processor resizes it (data.min_pixels, data.max_pixels).",
        config_help="a YAML config file, as for reinforge train", example="model.path=/models/qwen2.5-7b")

    from reinforge.config import ConfigError, load_config

    # the flags are overrides like any other, so the config's checks see them
    sizes_given = {"gpu_memory_gib": known.gpu_memory_gib, "host_memory_gib": known.host_memory_gib}
    workload = [f"{key}={getattr(known, flag[2:].replace('-', '_'))}" for flag, key in PLAN_WORKLOAD_FLAGS.items()
                if getattr(known, flag[2:].replace("-", "_")) is not None]
    given = [*workload, *overrides,
             *(f"trainer.{key}={value}" for key, value in sizes_given.items() if value is not None)]
    config = load_config(config_path, [*shape_overrides, *given])  # the schema's rules; none asks for the device
    if shape_image is not None:  # the image's tokens under the run's pixel bounds, below the command line's keys
        image_size, text_tokens = shape_image
        image_tokens = _image_tokens_of(config, image_size)
        config = load_config(config_path, [*shape_overrides, f"data.max_image_tokens={image_tokens}",
                                           f"data.max_prompt_length={text_tokens + image_tokens}", *given])
    elif known.image_size is not None:
        image_tokens = _image_tokens_of(config, known.image_size)
        if image_tokens > config.data.max_prompt_length:
            raise ConfigError(f"--image-size {known.image_size} (command line) makes {image_tokens} image tokens a "
                              f"prompt, more than data.max_prompt_length={config.data.max_prompt_length}; raise "
                              "max_prompt_length to hold the image and its text")
        config.data.max_image_tokens = image_tokens
    import dataclasses

    from reinforge.trainer.preflight import check_batch_splits, check_config, check_devices

    check_config(config)  # the rules of reinforge train, except the device checks of preflight
    # train's refusals of the devices the run asks for, except whether this machine has the planned card
    check_devices(dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, device="cpu")))
    check_batch_splits(config)
    from reinforge.rollout.registry import check_plugin_engine

    check_plugin_engine(config.rollout.name)  # a rollout engine train would not find is refused here too
    from reinforge.trainer.ineffective_settings import warn_ineffective_settings

    warn_ineffective_settings(config)  # as train warns of them, before the plan
    if not config.model.path:
        raise ConfigError("model.path is not set; pass model.path=/path/to/hf_model (the planner reads its config.json)")
    from reinforge.engine.memory_plan import ModelShape, check_model_config
    from reinforge.trainer.preflight import check_writes_text

    check_writes_text(config.model.path, "model.path")  # a classification model's folder, refused as train does
    check_model_config(config.model.path)  # a config.json train refuses before its model loads, plan refuses too
    from reinforge.trainer.preflight import check_router_aux_loss_has_experts

    check_router_aux_loss_has_experts("actor.router_aux_loss_coef", config.actor.router_aux_loss_coef, config.model)
    from reinforge.algorithms.roles import critic_enabled

    if critic_enabled(config) and ModelShape.from_model_path(config.model.path).vision is not None:  # as train refuses
        raise ConfigError(f"algorithm.adv_estimator={config.algorithm.adv_estimator} trains a critic, and "
                          f"{config.model.path} is a vision-language model, whose critic reinforge does not build; "
                          "use a critic-free estimator (grpo, rloo, reinforce_plus_plus, ...)")

    import torch

    if config.trainer.gpu_memory_gib is None and config.trainer.device != "cpu" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={config.trainer.device} plans for a GPU, and this machine has none to "
                          "measure; pass --gpu-memory-gib N to plan for a card of N GiB (or trainer.device=cpu)")
    from reinforge.engine.lora import check_target_modules
    from reinforge.workers.memory_settings import memory_plan, native_fallback_reason

    if config.model.lora.rank > 0:  # train refuses adapters that match no layer before planning; so does plan
        check_target_modules(config.model.lora, config.model.path)
    from reinforge.models.loading import is_local_path
    from reinforge.models.value_model import check_critic_folder

    if critic_enabled(config) and config.critic.model_path and is_local_path(config.critic.model_path):
        check_critic_folder(config.critic.model_path, "critic.model_path", config.model.trust_remote_code)  # as train
    _check_reward_model_folder(config)
    from reinforge.models import warn_if_beyond_context

    # train warns of lengths past the model's positions; plan, which reads the same config.json, warns too
    warn_if_beyond_context(config.model.path, config.data.max_prompt_length + config.data.max_response_length,
                           "data.max_prompt_length + data.max_response_length",
                           f"the {known.model} shape" if shape_overrides and known.model else None)
    reason = native_fallback_reason(config)
    if reason is not None:  # train says so once the model loads; the plan counts the hf backend's memory
        from reinforge.rollout.native import hf_fallback_notice

        logging.getLogger(__name__).warning(hf_fallback_notice(reason))
    print(memory_plan(config).table())  # MemoryPlanError (a ValueError): one line, exit 2, as train
    return 0


def _check_reward_model_folder(config) -> None:
    """reward.reward_model.model_path refused as train refuses it (not a one-label classification model) where it is
    a whole local model folder; a folder of config.json alone, or a hub id, is read for its sizes only."""
    from reinforge.models.loading import check_model_folder, is_local_path
    from reinforge.models.reward_model import check_reward_model

    settings = config.reward.reward_model
    if not settings.enable or not settings.model_path or not is_local_path(settings.model_path):
        return
    try:
        check_model_folder(settings.model_path, "reward.reward_model.model_path")
    except FileNotFoundError:
        return  # the planner reads its config.json, or names what is missing
    check_reward_model(settings.model_path, settings.trust_remote_code)


def _image_tokens_of(config, image_size: str) -> int:
    """The image tokens of one ``image_size`` image for the run's vision-language model (``config.model.path``), as
    its processor makes them: its preprocessor_config.json within the run's data.min_pixels and data.max_pixels."""
    from reinforge.config import ConfigError
    from reinforge.data.multimodal import image_tokens_of_size
    from reinforge.engine.memory_plan import ModelShape
    from reinforge.models.vision import folder_image_processor, set_pixel_bounds

    path = config.model.path
    tower = ModelShape.from_model_path(path).vision if path else None
    if tower is None:
        raise ConfigError(f"--image-size {image_size} (command line) counts a vision-language model's image tokens, "
                          f"and model.path={path or 'null'} has no vision tower; drop --image-size")
    image_processor = folder_image_processor(path, config.model.trust_remote_code, tower.patch_size, tower.merge_size)
    set_pixel_bounds(image_processor, config.data.min_pixels, config.data.max_pixels, path)
    width, height = _image_side(image_size)
    try:
        return image_tokens_of_size(image_processor, width, height)
    except ValueError as error:  # the processor's own refusal of the image's shape
        raise ConfigError(f"--image-size {image_size} (command line) is an image the processor of {path} refuses "
                          f"({error}); give sides closer to each other") from None


def _sft(argv: list[str]) -> int:
    config_path, overrides = _config_arguments(
        argv, prog="reinforge sft", description="Supervised fine-tuning on chat conversations (loss on assistant tokens).",
        config_help="a YAML config file (data:, model:, optim:, trainer: sections)",
        example="optim.lr=1e-5 data.packing=true")

    from reinforge.config import load_sft_config

    config = load_sft_config(config_path, overrides)
    from reinforge.trainer.sft_trainer import SFTTrainer

    SFTTrainer(config).fit()  # its constructor runs trainer.preflight.preflight_sft
    return 0


def _rm(argv: list[str]) -> int:
    config_path, overrides = _config_arguments(
        argv, prog="reinforge rm", description="Train a reward model on chosen/rejected pairs (Bradley-Terry).",
        config_help="a YAML config file (data:, model:, optim:, trainer:, rm: sections)",
        example="model.path=Qwen/Qwen2.5-0.5B data.train_files=[pairs.jsonl]")

    from reinforge.config.preference_schema import load_rm_config

    config = load_rm_config(config_path, overrides)
    from reinforge.trainer.preference.rm_trainer import RewardModelTrainer

    RewardModelTrainer(config).fit()  # its constructor checks every row before a model loads
    return 0


def _dpo(argv: list[str]) -> int:
    config_path, overrides = _config_arguments(
        argv, prog="reinforge dpo", description="Direct Preference Optimization on chosen/rejected pairs.",
        config_help="a YAML config file (data:, model:, optim:, trainer:, dpo: sections)",
        example="dpo.beta=0.1 dpo.loss_type=ipo")

    from reinforge.config.preference_schema import load_dpo_config

    config = load_dpo_config(config_path, overrides)
    from reinforge.trainer.preference.dpo_trainer import DPOTrainer

    DPOTrainer(config).fit()  # its constructor checks every row before a model loads
    return 0


def _eval(argv: list[str]) -> int:
    from reinforge.trainer.evaluate import eval_main

    return eval_main(argv)


def _demo(argv: list[str]) -> int:
    if "--agent" in argv:
        from reinforge.demo.agent_runner import agent_demo_main

        return agent_demo_main([arg for arg in argv if arg != "--agent"])
    if "--vision" in argv:
        from reinforge.demo.vision_runner import vision_demo_main

        return vision_demo_main([arg for arg in argv if arg != "--vision"])
    from reinforge.demo.runner import demo_main

    return demo_main(argv)


def _export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="reinforge export",
                                     description="Write a Hugging Face model folder from a checkpoint.")
    parser.add_argument("checkpoint", help="a checkpoint folder (RUN/checkpoints/step_N) or a run folder (its latest)")
    parser.add_argument("out", help="the HF folder to write (new or empty)")
    parser.add_argument("--force", action="store_true", help="write over a non-empty output folder")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="the weights' dtype in the folder (default: the one the checkpoint's hf/config.json "
                             "names, the run's compute dtype: bfloat16 for a GPU run, the policy its rollouts and "
                             "validation sampled from); float32 writes the master weights, with the updates of an RL "
                             "run too small for bfloat16 to resolve")
    args = parser.parse_args(argv)
    import torch

    from reinforge.trainer.export import export_checkpoint

    dtype = getattr(torch, args.dtype) if args.dtype else None
    print(export_checkpoint(args.checkpoint, args.out, dtype=dtype, force=args.force))
    return 0


def _plot(argv: list[str]) -> int:
    from reinforge.tracking.plots import plot_main

    return plot_main(argv)


def _bench(argv: list[str]) -> int:
    """``reinforge bench [rollout|train|agent|modes|dpo|serve|table|kernels] ...`` (``reinforge.bench``)."""
    from reinforge.bench import bench_main

    return bench_main(argv)


def _compares_a_prompts_samples(estimator: str) -> bool:
    from reinforge.algorithms import ADVANTAGE_ESTIMATORS

    return estimator in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS[estimator].needs_groups


def _config(argv: list[str]) -> int:
    from reinforge.config.commands import config_main
    from reinforge.trainer.preflight import check_config

    return config_main(argv, check_config, _compares_a_prompts_samples)


def _data(argv: list[str]) -> int:
    from reinforge.data.commands import data_main

    return data_main(argv)


def _init(argv: list[str]) -> int:
    from reinforge.examples import init_main

    return init_main(argv)


def _sandbox(argv: list[str]) -> int:
    from reinforge.sandbox.server import sandbox_main

    return sandbox_main(argv)


def _serve(argv: list[str]) -> int:
    from reinforge.serve.command import serve_main

    return serve_main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "init": (_init, "write the example configs (GRPO, DAPO, PPO, ReTool, RM, DPO) into ./examples, or NAME into DIR"),
    "train": (_train, "RL training from a YAML config and a.b=c overrides"),
    "plan": (_plan, "the memory plan of a run on a GPU of any size (fits or not, and why)"),
    "sft": (_sft, "supervised fine-tuning on chat data (loss on assistant tokens)"),
    "rm": (_rm, "train a reward model on chosen/rejected pairs (for reward.reward_model)"),
    "dpo": (_dpo, "Direct Preference Optimization of a model on chosen/rejected pairs"),
    "eval": (_eval, "accuracy of a model on a dataset of verifiable prompts (greedy by default)"),
    "demo": (_demo, "watch a small model learn arithmetic by RL, on the CPU in minutes"),
    "export": (_export, "write an HF model folder from a checkpoint"),
    "plot": (_plot, "render PNG plots of one or more runs' metrics.jsonl"),
    "bench": (_bench, "speed on standard workloads: rollout (default), train, agent, modes, dpo, serve; table merges train runs; kernels sweeps CUDA kernels"),
    "data": (_data, "prepare datasets (e.g. reinforge data gsm8k --src DIR --out DIR)"),
    "config": (_config, "translate a verl command line into a reinforge YAML (config from-verl KEY=VALUE ...)"),
    "sandbox": (_sandbox, "serve a code sandbox for tool-using agents (reinforge sandbox serve --port 8080)"),
    "serve": (_serve, "an OpenAI-compatible endpoint on a model or checkpoint (reinforge serve RUN_DIR --port 8000)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<8} {help_text}" for name, (_, help_text) in COMMANDS.items()]
        usage = "usage: reinforge <command> [args]\n\ncommands:\n" + "\n".join(lines)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown command {argv[0]!r}\n\n{usage}", file=sys.stderr)
            return 2
        print(usage)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    # torch's own level, which its import sets only at its end: a Ctrl-C inside the import would otherwise leave its
    # loggers at the root's INFO, and its exit hooks (FakeTensor's cache statistics) would print under our last line
    logging.getLogger("torch").setLevel(logging.WARNING)
    command, _ = COMMANDS[argv[0]]
    import signal
    import threading

    from reinforge.cli_errors import one_line_report, one_line_usage_errors
    from reinforge.config import ConfigError
    from reinforge.stop_signals import exit_after_stop, install_stop_handlers, stop_signal, stopped_message

    debug = os.environ.get("REINFORGE_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    training = argv[0] in ("train", "sft", "rm", "dpo")
    if training or argv[0] == "serve":
        # a run stops cleanly on SIGTERM too, and resumes from its checkpoint; an endpoint stops on Ctrl-C and SIGTERM
        # also where it was started with SIGINT ignored (a background job of a script, a CI runner's worker)
        install_stop_handlers()
    try:
        with one_line_usage_errors():
            return command(argv[1:])
    except KeyboardInterrupt:
        print(stopped_message() if training else "interrupted", file=sys.stderr)
        return exit_after_stop()
    except (ConfigError, ValueError, FileNotFoundError, OSError) as error:
        # Mistakes in configs, data and paths are reported as one line; REINFORGE_DEBUG=1 shows the traceback.
        if debug:
            raise
        if isinstance(error, TimeoutError):  # a worker deadline's message carries the member's log lines
            print(f"error: {error}", file=sys.stderr)
            return 1
        message = " ".join(str(error).split())
        print(f"error: {message}", file=sys.stderr)
        return 2
    except Exception as error:
        # A failure inside the run (a worker's error, out of memory): its own last line, not the traceback.
        if debug:
            raise
        from reinforge.workers.memory_settings import describe_out_of_memory

        out_of_memory = describe_out_of_memory(error)
        print(f"error: {out_of_memory}" if out_of_memory else one_line_report(error), file=sys.stderr)
        return 1
    finally:
        # after a stop the second signal must still exit at once with 130, also while the interpreter
        # tears down (Python's own handler would raise KeyboardInterrupt there and die by SIGINT)
        if threading.current_thread() is threading.main_thread() and not stop_signal:
            for signum, handler in previous.items():
                if handler is not None:
                    signal.signal(signum, handler)


if __name__ == "__main__":  # python -m reinforge.cli, like python -m reinforge
    raise SystemExit(main())
