"""reinforge from Python: trainers that take what a script or a notebook has in hand, named as in TRL.

    from reinforge import GRPOConfig, GRPOTrainer

    def correct(completions, answer, **kwargs):
        return [float(text.strip() == expected) for text, expected in zip(completions, answer)]

    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=[correct, short], train_dataset=frame,
                          args=GRPOConfig(output_dir="runs/api", learning_rate=1e-6, reward_weights=[1.0, 0.2]))
    trainer.train()

A trainer runs in this process, on the same code as ``reinforge train``/``sft``: the run folder, its checks
before any model loads, checkpoints and resume are the CLI's. What it is given becomes what the CLI would read:

- ``model``: a path or hub id, or a loaded transformers model (saved into ``<output_dir>/initial_model``, with
  ``processing_class``, the tokenizer, or the one its ``name_or_path`` names; ``train`` copies the trained weights
  back into it, as TRL trains the object it is given);
- ``train_dataset``/``eval_dataset``: a ``datasets.Dataset``, a pandas frame, a list of dicts (written into
  ``<output_dir>/inputs`` as parquet), or files (parquet, JSONL, ``save_to_disk`` folders). Rows follow TRL's
  columns: ``prompt`` (a string, fed as it is unless ``data.apply_chat_template`` asks for the template, or chat
  messages), any other column reaching the reward functions by name; a ``ground_truth`` column becomes verl's
  ``reward_model.ground_truth``, which the built-in scorers and a function's ``ground_truth`` argument read;
- ``reward_funcs``: one function or a list (TRL's kind, called once per batch, or verl's), weighted by
  ``reward_weights``; a ``.py`` path with ``:function`` loads one from a file, any other string (or a
  loaded sequence-classification model) is a reward model (``reward.reward_model``, its weighted score added);
  none: each row's ``data_source`` picks a built-in scorer;
- ``peft_config``: a peft ``LoraConfig``, as ``model.lora`` (rank, alpha, dropout, target modules);
- ``args``: a ``GRPOConfig``/``SFTConfig`` (TRL's names where the meaning is the same, plus ``overrides``:
  reinforge's own keys, ``{"rollout.top_p": 0.9}``), or a reinforge ``Config``; ``**overrides`` on the
  trainer are reinforge keys with ``__`` for the dots (``reward__num_workers=0``).

Nothing here needs an ``if __name__ == "__main__":`` guard: the scorer processes never import the main module,
and reward functions reach them by value (cloudpickle); ``reward.num_workers=0`` scores in this process."""

from reinforge.api.inputs import peft_settings, reward_functions_of, save_model_if_loaded, write_dataset
from reinforge.api.settings import DPOConfig, GRPOConfig, RewardConfig, SFTConfig
from reinforge.api.trainers import DPOTrainer, GRPOTrainer, RewardTrainer, SFTTrainer, TrainOutput

__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "RewardConfig", "RewardTrainer", "SFTConfig",
           "SFTTrainer", "TrainOutput", "peft_settings", "reward_functions_of", "save_model_if_loaded", "write_dataset"]
