"""verl's config files a command may pick with ``--config-name``, as the keys each sets over ``ppo_trainer.yaml``.

verl's examples run ``python3 -m verl.trainer.main_ppo --config-path=... --config-name=NAME`` with a
file that takes ``ppo_trainer`` and changes a few keys (the multi-turn GSM8K and ReTool examples
turn multi-turn on and set the turn limit and lengths). The translation applies those keys first,
then the command's own, as Hydra does; any other name is refused in one line that names the keys
to pass instead.
"""

from __future__ import annotations

from typing import Any

from reinforge.config.errors import ConfigError

_ROLLOUT = "actor_rollout_ref.rollout"
_MULTI_TURN_GRPO: dict[str, Any] = {
    "data.max_prompt_length": 1024, "data.max_response_length": 1024, "data.train_batch_size": 256,
    "data.return_raw_chat": True, "actor_rollout_ref.hybrid_engine": True, f"{_ROLLOUT}.name": "sglang",
    f"{_ROLLOUT}.multi_turn.enable": True,
}

_DAPO: dict[str, Any] = {
    "trainer.project_name": "verl-dapo", "reward.reward_manager.name": "dapo",
    "algorithm.filter_groups.max_num_gen_batches": 0,
}
"""The DAPO recipe's files (verl-recipe dapo/config), which its main_dapo reads when no --config-name is given."""

VERL_CONFIG_FILES: dict[str, dict[str, Any]] = {
    "ppo_trainer": {},
    "ppo_megatron_trainer": {},
    "gsm8k_multiturn_grpo": {**_MULTI_TURN_GRPO, f"{_ROLLOUT}.multi_turn.max_assistant_turns": 5},
    "gsm8k_multiturn_megatron_grpo": {**_MULTI_TURN_GRPO, f"{_ROLLOUT}.multi_turn.max_assistant_turns": 5},
    "gsm8k_multiturn_grpo_server": {**_MULTI_TURN_GRPO, f"{_ROLLOUT}.multi_turn.max_assistant_turns": 5},
    "gsm8k_multiturn_grpo_w_interaction": {**_MULTI_TURN_GRPO, f"{_ROLLOUT}.multi_turn.max_user_turns": 5},
    "retool_multiturn_grpo": {**_MULTI_TURN_GRPO, f"{_ROLLOUT}.multi_turn.max_assistant_turns": 5,
                              f"{_ROLLOUT}.multi_turn.tool_config_path":
                                  "./config/tool_config/sandbox_fusion_tool_config.yaml"},
    "dapo_trainer": dict(_DAPO),
    "dapo_megatron_trainer": dict(_DAPO),
    "search_multiturn_grpo": {**_MULTI_TURN_GRPO, "data.shuffle": False,
                              f"{_ROLLOUT}.multi_turn.max_assistant_turns": 2, f"{_ROLLOUT}.multi_turn.format": "qwen"},
    "one_step_off_ppo_trainer": {},
    "one_step_off_ppo_megatron_trainer": {},
    "fully_async_ppo_trainer": {},
    "fully_async_ppo_megatron_trainer": {},
}
"""Each config name and the verl keys it sets (``ppo_trainer`` and the Megatron one set none beyond verl's defaults;
the off-policy trainers' own files are what their entry points read, ``entry_points.py``)."""

KEY_SETTINGS = (f"{_ROLLOUT}.multi_turn.enable=true", f"{_ROLLOUT}.multi_turn.tool_config_path=...",
                f"{_ROLLOUT}.multi_turn.max_assistant_turns=...", "data.max_prompt_length=...",
                "data.max_response_length=...", "data.train_batch_size=...")


def config_file_settings(option: str, value: str) -> dict[str, Any]:
    """The keys the config ``value`` (a name, or a path ending in NAME.yaml) sets; ConfigError for an unknown one."""
    name = value.strip("'\"").rsplit("/", 1)[-1].removesuffix(".yaml")
    if name not in VERL_CONFIG_FILES:
        raise ConfigError(f"{option}={value} (verl command line) picks a config file reinforge does not know (it knows "
                          f"{', '.join(VERL_CONFIG_FILES)}); leave the option out and pass the keys that file sets "
                          f"as key=value words, e.g. {' '.join(KEY_SETTINGS)}")
    return dict(VERL_CONFIG_FILES[name])
