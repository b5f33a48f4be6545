"""Datasets for RL and SFT: reading rows, chat templates, prompt filtering, prompt batches, built-in tasks.

The trainer builds ``RLDataset.from_config(config.data, tokenizer, "train")`` and iterates
``PromptLoader.for_training(dataset, config.data, get_pad_token_id(tokenizer))``.
"""

from reinforge.data.chat_template import encode_prompt, get_pad_token_id, render_prompt
from reinforge.data.prompt_loader import PromptLoader, collate_prompts
from reinforge.data.rl_dataset import PromptExample, RLDataset

__all__ = ["PromptExample", "PromptLoader", "RLDataset", "collate_prompts", "encode_prompt", "get_pad_token_id",
           "render_prompt"]
