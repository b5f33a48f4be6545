"""``reinforge eval``: a model's accuracy on verifiable prompts, scored as validation scores them.

It generates ``rollout.val_kwargs.n`` answers per prompt of ``data.val_files`` (greedy by
default), scores them with the data source's scorer and reports the validation metrics
(``val-core/<source>/acc/mean@1``, ...). The demo uses it to measure the SFT model it builds.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from reinforge.config import Config, load_config
from reinforge.config.loader import ConfigError
from reinforge.data.files import GLOB_CHARACTERS

logger = logging.getLogger(__name__)


def evaluate(config: Config) -> dict[str, float]:
    """Validation metrics of ``config.model.path`` on ``config.data.val_files``."""
    from reinforge.agent import check_agent_rows, check_tools, load_tools
    from reinforge.data import PromptLoader, RLDataset
    from reinforge.models import load_tokenizer
    from reinforge.reward.data_checks import check_rows_can_be_scored, load_reward_function
    from reinforge.rollout.base import SamplingParams
    from reinforge.trainer.preflight import check_config, check_devices
    from reinforge.trainer.validation import run_validation
    from reinforge.workers.actor_rollout import ActorRolloutWorker
    from reinforge.workers.reward import RewardWorker

    check_config(config)
    check_devices(config)
    custom_scorer = load_reward_function(config.reward)
    tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path,
                               trust_remote_code=config.model.trust_remote_code)
    from reinforge.serve.agents import register_configured_agents

    register_configured_agents(config.rollout.multi_turn)  # rollout.multi_turn.openai_agents, as agent loops
    tools = load_tools(config.rollout.multi_turn)
    check_tools(config.rollout.multi_turn.format, tools)  # before the model loads, as train does
    from reinforge.models.vision import run_processor, why_no_images

    processor = run_processor(config.model, config.data)
    why = None if processor is not None else why_no_images(config.model.path, config.model.trust_remote_code)
    dataset = RLDataset.from_config(config.data, tokenizer, split="val",
                                    tool_schemas=[tool.schema for tool in tools.values()], processor=processor,
                                    why_no_images=why)
    check_rows_can_be_scored(dataset, config.reward, custom_scorer)
    check_agent_rows(((dataset.where(example), example.agent_name, example.extra_info)
                      for example in dataset.examples), tools)
    actor = ActorRolloutWorker(config, total_training_steps=1)
    reward = RewardWorker(config)
    loader = PromptLoader.for_validation(dataset, config.data, actor.tokenizer.pad_token_id)
    val = config.rollout.val_kwargs
    sampling = SamplingParams(max_tokens=config.data.max_response_length, temperature=val.temperature,
                              top_p=val.top_p, top_k=val.top_k, stop_token_ids=tuple(config.rollout.stop_token_ids))
    return run_validation(loader, val.n, sampling, config.trainer.seed + 7, actor.generate, reward.score)


def checkpoint_to_evaluate(path: str) -> str:
    """``path``, or for a run folder (``checkpoints/`` and no config.json) its newest checkpoint that is complete, as
    resume chooses (its files of the sizes its manifest lists, its ``hf/`` model whole), naming in one warning the
    newer ones it skips; a checkpoint folder given itself is refused in one line where it is incomplete."""
    from reinforge.trainer.checkpoint import MANIFEST_FILE, newest_usable

    folder = Path(path).expanduser()
    if not folder.is_dir() or (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file():
        return path
    if (folder / MANIFEST_FILE).is_file() or (folder / "trainer_state.pt").is_file():  # a checkpoint folder
        from reinforge.trainer.checkpoint import checkpoint_problem, is_hf_weights

        # hf/ weights removed to save space are said by model_folder, which points at reinforge export
        problem = checkpoint_problem(folder, hashes=False, may_be_missing=is_hf_weights)
        if problem is not None:
            raise ConfigError(f"reinforge eval: checkpoint {path} is incomplete: {problem}; give another checkpoint, "
                              f"or the run folder {folder.parent.parent} for its newest complete one")
        return path
    if not (folder / "checkpoints").is_dir():
        return path
    checkpoint, skipped = newest_usable(folder, _checkpoint_problem)
    if checkpoint is not None:
        if skipped:
            logger.warning("evaluating %s, the newest complete checkpoint of %s; skipped %s", checkpoint.name, path,
                           "; ".join(skipped))
        return str(checkpoint)
    if skipped:
        raise ConfigError(f"reinforge eval: run folder {path} has no complete checkpoint ({'; '.join(skipped)}); give "
                          "an HF model folder, or a run folder whose checkpoint was written whole")
    return path


def _checkpoint_problem(folder: Path) -> str | None:
    """Why checkpoint ``folder`` cannot be evaluated: its files against its manifest (sizes), then its ``hf/``
    model (``check_model_folder``: no weights, a cut-off safetensors file); None where it can."""
    from reinforge.models.loading import check_model_folder
    from reinforge.trainer.checkpoint import checkpoint_problem

    problem = checkpoint_problem(folder, hashes=False)
    if problem is not None:
        return problem
    try:
        check_model_folder(folder / "hf", "the model")
    except FileNotFoundError as error:
        return str(error)
    return None


def check_weights_fit(path: str, trust_remote_code: bool) -> None:
    """A local model folder's weights against its config.json, before any data or weight loads: a folder
    ``check_model_folder`` refuses (half-written, cut off), or whose safetensors weights have other shapes than its
    config.json builds, is one line (train refuses the same once its model loads)."""
    from reinforge.models.loading import check_model_folder, is_local_path, mismatched_weight_shapes
    from reinforge.models.random_weights import random_weights_seed

    if not is_local_path(path) or random_weights_seed(path) is not None:
        return
    try:
        check_model_folder(path, "the model")
    except FileNotFoundError as error:
        raise ConfigError(f"reinforge eval: {error}") from None
    mismatch = mismatched_weight_shapes(path, trust_remote_code)
    if mismatch is not None:
        raise ConfigError(f"reinforge eval: {path}: its weights do not fit its config.json ({mismatch}); fix "
                          "config.json's sizes to the weights', or give the folder they came with")


def model_folder(path: str) -> str:
    """The HF folder to evaluate for ``path``: itself, a checkpoint's ``hf/``, or a run folder's newest complete
    checkpoint's (``checkpoint_to_evaluate``); a LoRA adapter folder is refused (its checkpoint's ``hf/`` holds the
    merged model)."""
    from reinforge.serve.command import resolve_model_folder

    path = checkpoint_to_evaluate(path)
    try:
        folder, adapter = resolve_model_folder(path)
    except (FileNotFoundError, ValueError) as error:
        raise ConfigError(f"reinforge eval: {error}") from None
    if adapter is not None:
        raise ConfigError(f"reinforge eval: {path} is a LoRA adapter folder; give the HF folder of the model it "
                          "adapts merged with it (a checkpoint's hf/), or serve it with `reinforge serve`, which "
                          "merges it")
    return folder


def is_override(item: str) -> bool:
    """Whether a word after the model is an ``a.b=c`` override rather than a data file: a path may hold ``=`` too (a
    partitioned dataset's ``split=test/``), so a word that names a file, or whose part before ``=`` is a path, is one."""
    key, equals, _ = item.partition("=")
    return bool(equals) and "/" not in key and not Path(item).expanduser().exists()


def eval_main(argv: list[str]) -> int:
    """``reinforge eval MODEL DATA [DATA ...] [a.b=c ...]``: prints the metrics as JSON."""
    parser = argparse.ArgumentParser(prog="reinforge eval",
                                     description="Accuracy of a model on RL-schema prompts (greedy unless told).")
    parser.add_argument("model", help="an HF model folder or hub id, a checkpoint folder (RUN/checkpoints/step_N) "
                        "or a run folder (its newest checkpoint)")
    parser.add_argument("data", nargs="+", help="parquet/JSONL files of prompts in the RL schema, then a.b=c "
                                                "overrides such as data.max_response_length=16 rollout.val_kwargs.n=4")
    args = parser.parse_args(argv)
    overrides = [item for item in args.data if is_override(item)]
    files = [item for item in args.data if not is_override(item)]
    if not files:
        raise ConfigError("reinforge eval needs at least one data file of prompts, e.g. data/arithmetic/test.parquet")
    for name in files:  # named as the command line gave them (load_config would name data.val_files)
        if not Path(name).expanduser().exists() and not any(character in name for character in GLOB_CHARACTERS):
            raise ConfigError(f"reinforge eval: data file {name!r} does not exist (looked for "
                              f"{Path(name).expanduser().resolve()}); give a parquet or JSONL file of prompts")
    model = Path(args.model).expanduser()
    if not model.exists() and (model.is_absolute() or args.model.startswith(".") or len(model.parts) != 2):
        raise ConfigError(f"reinforge eval: model folder {args.model!r} does not exist (looked for {model.resolve()}); "
                          "give an HF model folder, e.g. RUN/checkpoints/step_N/hf")
    config = load_config(None, [f"model.path={model_folder(args.model)}", f"data.val_files={json.dumps(files)}",
                                *overrides])
    check_weights_fit(config.model.path, config.model.trust_remote_code)  # before the data and the model load
    metrics = evaluate(config)
    print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0 if metrics else 1


if __name__ == "__main__":
    sys.exit(eval_main(sys.argv[1:]))
