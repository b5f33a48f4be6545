"""The trainers of the Python API: TRL's signatures over reinforge's RL, SFT, DPO and reward-model trainers."""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from reinforge.api.inputs import (
    as_conversations,
    first_row,
    formatted_rows,
    mark_trained,
    peft_settings,
    reward_functions_of,
    save_model_if_loaded,
    save_tokenizer_if_given,
    sft_loss_on,
    whole_prompts,
    write_dataset,
)
from reinforge.api.settings import (
    DPOConfig,
    GRPOConfig,
    RewardConfig,
    SFTConfig,
    evaluates,
    keyword_overrides,
    load_settings,
    step_intervals,
)
from reinforge.config.errors import ConfigError

logger = logging.getLogger(__name__)


def _load(spec: str) -> Any:
    """``module:name`` -> the object, imported when the trainer is built (``import reinforge`` stays light)."""
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def _named_as_given(args: Any) -> Iterator[None]:
    """A refusal that names one of reinforge's keys made from TRL's settings (``args.setting_sources()``) also names
    the settings it was made from, as the script wrote them: ``num_generations=1 (GRPOConfig) is reinforge's
    rollout.n: rollout.n=1 is too small...``; also ``trainer.loggers names wandb, ...`` (a list's refusal)."""
    try:
        yield
    except ValueError as error:
        sources = args.setting_sources() if hasattr(args, "setting_sources") else {}
        message = str(error)
        found = [(match.start(), key) for key in sources
                 if (match := re.search(rf"(?<![\w.]){re.escape(key)}(=| names )", message)) is not None]
        if not found or type(error) not in (ValueError, ConfigError) or message.startswith(sources[min(found)[1]]):
            raise
        key = min(found)[1]
        raise type(error)(f"{sources[key]} ({type(args).__name__}) is reinforge's {key}: {message}") from None


def _evaluates(args: Any) -> bool:
    """Whether the eval_dataset is given to the run: not under TRL's eval_strategy='no', which never evaluates it (a
    reinforge config given as args evaluates it, every trainer.test_every steps and at the end)."""
    if not hasattr(args, "with_defaults") or evaluates(args.with_defaults()):
        return True
    logger.info("eval_strategy='no': the eval_dataset is not evaluated; set eval_strategy='steps' (with eval_steps) or "
                "'epoch' to evaluate it")
    return False


def _check_eval_dataset(args: Any, eval_dataset: Any, settings: dict[str, Any], trainer: str) -> None:
    """TRL's refusal of an evaluation strategy with nothing to evaluate: eval_strategy='steps' or 'epoch' and no
    eval_dataset (nor a data.val_files override) is refused, as transformers' Trainer refuses it."""
    if eval_dataset is not None or settings.get("data.val_files") or not hasattr(args, "with_defaults"):
        return
    strategy = args.with_defaults().get("eval_strategy")
    if strategy in ("steps", "epoch"):
        raise ValueError(f"eval_strategy={strategy!r} ({type(args).__name__}) evaluates an eval_dataset, and "
                         f"{trainer} was given none; pass eval_dataset=... or set eval_strategy='no'")


def _check_train_data(config: Any, trainer: str) -> None:
    if not config.data.train_files:
        raise ValueError(f"{trainer} has no train_dataset; pass train_dataset= a datasets.Dataset, a pandas frame, a "
                         "list of dicts or data files")


class TrainOutput(NamedTuple):
    """What ``train()`` returns, as TRL's (transformers') ``TrainOutput``: the step reached, the mean training loss
    over the steps ``train()`` trained, and the last step's metrics. ``output["train/loss"]`` reads a metric."""

    global_step: int
    training_loss: float
    metrics: dict[str, Any]

    def __getitem__(self, key):  # type: ignore[override]
        return self.metrics[key] if isinstance(key, str) else tuple.__getitem__(self, key)


LOSS_KEYS = ("train/loss", "actor/pg_loss")
"""The loss each trainer logs: SFT, DPO and reward models ``train/loss``; RL the policy-gradient loss."""


def _train_output(run_dir: Path, first_step: int, last_step: int, metrics: dict[str, Any],
                  updates: int = 1) -> TrainOutput:
    """The mean of the logged loss over steps ``first_step + 1 .. last_step`` of ``metrics.jsonl`` (NaN when none
    was trained); the step reached in TRL's optimizer steps, ``updates`` a reinforge step."""
    from reinforge.tracking.jsonl import METRICS_FILE, read_json_lines

    path = run_dir / METRICS_FILE
    rows = read_json_lines(path) if path.exists() else []
    trained = [row for row in rows if first_step < row.get("step", 0) <= last_step]
    key = next((key for key in LOSS_KEYS if any(key in row for row in trained)), None)
    losses = [float(row[key]) for row in trained if key in row and row[key] is not None]
    return TrainOutput(last_step * updates, sum(losses) / len(losses) if losses else float("nan"), dict(metrics))


class _Trainer:
    """What every API trainer has: ``config``, ``trainer`` (reinforge's own), ``train``, ``save_model``, and TRL's
    ``state``, ``model`` and ``processing_class``."""

    config: Any
    trainer: Any
    args: Any = None
    """The TRL-named settings given (a GRPOConfig, SFTConfig...), or reinforge's config; what callbacks get as args."""
    given_model: Any = None
    """The model object the trainer was given (None for a path): ``train`` leaves the trained weights in it."""
    updates: int = 1
    """Optimizer steps a reinforge step makes: TRL's steps (``state.global_step``, ``on_step_end``) count them."""
    MODEL_CLASS = "transformers:AutoModelForCausalLM"
    """``module:name`` of the class ``model`` loads the trained model with."""

    def _start_callbacks(self, callbacks: Any) -> None:
        """``state`` as the run stands, and the callbacks hooked into its tracker (``on_init_end`` called)."""
        from reinforge.api.callbacks import CallbackHandler, callback_objects, logged_history, make_state

        self._loaded_model: tuple[int, Any] | None = None
        self._fitted = False
        self.state = make_state(int(getattr(self.trainer, "total_steps", 0) or 0) * self.updates,
                                logged_history(self.output_dir, self._trained_steps(), self.updates))
        self.callback_handler = CallbackHandler(callback_objects(callbacks), self.args, self.state)
        self._hook_callbacks()
        self.callback_handler.call("on_init_end")

    def add_callback(self, callback: Any) -> None:
        """TRL's (transformers'): a callback (class or instance) added to those the run calls."""
        from reinforge.api.callbacks import callback_objects

        self.callback_handler.callbacks.extend(callback_objects([callback]))

    def pop_callback(self, callback: Any) -> Any:
        """TRL's: the callback (an instance, or the first instance of a class or of its subclasses, as transformers
        finds it) taken out of those the run calls and returned; None where there is none."""
        for made in self.callback_handler.callbacks:
            if made is callback or (isinstance(callback, type) and isinstance(made, callback)):
                self.callback_handler.callbacks.remove(made)
                return made
        return None

    def remove_callback(self, callback: Any) -> None:
        """TRL's: the callback (an instance, or the first of a class) taken out of those the run calls."""
        self.pop_callback(callback)

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        """TRL's upload of the model: reinforge does not upload, and says what does, in one line."""
        raise NotImplementedError("trainer.push_to_hub(): reinforge does not upload; trainer.save_model() writes the "
                                  "model folder, which huggingface_hub's HfApi().upload_folder(folder_path=..., "
                                  "repo_id=...) pushes")

    def _hook_callbacks(self) -> None:
        """The callbacks into ``self.trainer``'s tracker, and its stop into their ``control``."""
        from reinforge.api.callbacks import CallbackBackend

        tracker = getattr(self.trainer, "tracker", None)
        if tracker is not None:
            loader = getattr(self.trainer, "train_loader", None)
            epoch_now = None
            if all(hasattr(loader, name) for name in ("epoch", "position", "__len__")):
                def epoch_now() -> float:  # TRL's state.epoch: whole epochs and the share of the current one
                    return loader.epoch + loader.position / max(1, len(loader))
            tracker.backends["trl_callbacks"] = CallbackBackend(self.callback_handler, self.updates, epoch_now)
        if self.trainer is not None:
            self.trainer.stop_requested = self.callback_handler.stop_requested
            self._evaluate_as_asked()

    def _evaluate_as_asked(self) -> None:
        """The evaluation interval of TRL's eval_strategy='epoch' (one epoch's steps), and that of an eval_steps or a
        save_steps below 1 (a fraction of the run's steps), which only the trainer's data gives: the run's loop
        validates and saves on them. The config keeps trainer.test_every and trainer.save_every as given, so a later
        run of the folder resumes with the same settings."""
        loader = getattr(self.trainer, "train_loader", None)
        if not hasattr(self.args, "with_defaults") or loader is None:
            return
        intervals = step_intervals(self.args.with_defaults(), len(loader), int(self.trainer.total_steps))
        if getattr(self.trainer, "val_loader", None) is None:
            intervals.pop("test_every", None)
        if not intervals:
            return
        run_steps = self.trainer.run_steps

        def run_steps_as_asked(*args: Any, **kwargs: Any) -> Any:
            return run_steps(*args, **(kwargs | intervals))

        self.trainer.run_steps = run_steps_as_asked
        for key, what in (("test_every", "the eval_dataset is evaluated"), ("save_every", "a checkpoint is saved")):
            if key in intervals:
                logger.info("%s every %d steps and at the end", what, intervals[key] * self.updates)

    def _make_trainer(self) -> Any:
        """reinforge's trainer of ``self.config``."""
        raise NotImplementedError

    def _fresh_trainer(self) -> None:
        """A trainer of the run again, for a ``train()`` after another: a finished ``fit`` has shut its workers,
        closed its tracker and released the run folder. It resumes from the latest checkpoint, as TRL's second
        ``train()`` goes on from the weights the first left; a callback's stop of the last call is cleared."""
        self.config = copy.deepcopy(self._given_config)  # a trainer fills in what it plans (micro-batches...)
        self.trainer = self._make_trainer()
        self.callback_handler.control.should_training_stop = False
        self._hook_callbacks()

    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainOutput:
        """Run the training (resuming where ``output_dir`` holds a checkpoint); TRL's ``TrainOutput``. A model given
        loaded holds the trained weights after it, as in TRL (reinforge trains a saved copy).

        ``resume_from_checkpoint``: TRL's; None or True resume from ``output_dir``'s latest checkpoint, as reinforge
        always does (``trainer.resume``); a checkpoint path or False is set as ``trainer.resume`` when the trainer
        is made (``overrides={"trainer.resume": ...}``)."""
        if resume_from_checkpoint not in (None, True):
            raise ValueError(f"train(resume_from_checkpoint={resume_from_checkpoint!r}): reinforge resumes from "
                             "output_dir's latest checkpoint; to start over or resume another checkpoint, make the "
                             "trainer with overrides={'trainer.resume': 'never'} (or the checkpoint's path)")
        if self._fitted:
            self._fresh_trainer()
        self._fitted = True
        first_step = self._trained_steps()
        total = int(getattr(self.trainer, "total_steps", 0) or 0)
        if total and first_step >= total:
            logger.warning("%s holds a run already at step %d of its %d; train() has nothing left to train (raise "
                           "max_steps or num_train_epochs, or give another output_dir)", self.output_dir,
                           first_step * self.updates, total * self.updates)
        self.state.max_steps = int(getattr(self.trainer, "total_steps", 0) * self.updates or self.state.max_steps)
        self.callback_handler.call("on_train_begin")
        started = time.perf_counter()
        metrics = self.trainer.fit()
        runtime = time.perf_counter() - started
        if self.given_model is not None:
            from reinforge.trainer.export import load_trained_weights

            if load_trained_weights(self.output_dir, self.given_model):
                mark_trained(self.given_model, self.config.model.path)
            else:
                logger.warning("the trained weights do not fit the model object given (a %s; a reward model's "
                               "score head is not a causal LM's), which keeps its weights as they were; "
                               "trainer.save_model() writes the trained model", type(self.given_model).__name__)
        output = _train_output(self.output_dir, first_step, self._trained_steps(), metrics, self.updates)
        summary = {"train_runtime": runtime, "train_loss": output.training_loss, "epoch": self.state.epoch}
        self.state.log_history.append(summary | {"step": output.global_step})
        self.callback_handler.call("on_train_end")
        return output._replace(metrics=output.metrics | summary)

    @property
    def model(self) -> Any:
        """TRL's ``trainer.model``: the model object given, which ``train`` updates; else the model loaded from the
        run's latest checkpoint (the starting model before one), on the CPU."""
        if self.given_model is not None:
            return self.given_model
        step = self._trained_steps()
        if self._loaded_model is None or self._loaded_model[0] != step:
            from reinforge.models.loading import NO_HUB_KERNELS

            model = self._model_class().from_pretrained(self.config.model.path, **self._model_options(),
                                                        **NO_HUB_KERNELS)
            if step:
                from reinforge.trainer.export import load_trained_weights

                load_trained_weights(self.output_dir, model)
            self._loaded_model = (step, model)
        return self._loaded_model[1]

    def _model_class(self) -> Any:
        """The class ``model`` loads the trained model with: ``MODEL_CLASS``."""
        return _load(self.MODEL_CLASS)

    def _model_options(self) -> dict[str, Any]:
        return {"trust_remote_code": bool(self.config.model.trust_remote_code)}

    @property
    def processing_class(self) -> Any:
        """TRL's ``trainer.processing_class``: the tokenizer the run trains with."""
        tokenizer = getattr(self.trainer, "tokenizer", None)
        if tokenizer is None:
            from reinforge.models import load_tokenizer

            tokenizer = load_tokenizer(self.config.model.tokenizer_path or self.config.model.path,
                                       trust_remote_code=bool(self.config.model.trust_remote_code))
        return tokenizer

    tokenizer = processing_class

    def _trained_steps(self) -> int:
        """The step the run stands at: before ``fit`` the checkpoint it will resume from (0 without one), after it
        the last step."""
        if getattr(self.trainer, "step", 0):
            return int(self.trainer.step)
        state = getattr(self.trainer, "_resume_state", None)
        return int(state["step"]) if state else 0

    @property
    def output_dir(self) -> Path:
        return Path(self.config.trainer.output_dir)

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """The latest checkpoint as an HF model folder (``<output_dir>/final_model`` unless given), as
        ``reinforge export`` writes it; returns the folder. The run folder itself (TRL's
        ``save_model(args.output_dir)``) gets the model's files beside the run's own. Before any checkpoint, the
        model as it starts, as TRL saves the model it holds."""
        target = Path(output_dir) if output_dir else self.output_dir / "final_model"
        if target.resolve() != self.output_dir.resolve():
            return self._write_model(target)
        staged = self.output_dir / ".saved_model.partial"
        shutil.rmtree(staged, ignore_errors=True)
        self._write_model(staged)
        for path in sorted(staged.iterdir()):
            if (self.output_dir / path.name).is_dir():
                shutil.rmtree(self.output_dir / path.name)
            path.replace(self.output_dir / path.name)
        staged.rmdir()
        return self.output_dir

    def _write_model(self, folder: Path) -> Path:
        """The run's latest checkpoint exported into ``folder`` (written over); the starting model before one."""
        from reinforge.trainer.export import export_checkpoint

        if self._trained_steps():
            return export_checkpoint(self.output_dir, folder, force=True)
        from reinforge.models.export import save_hf_folder

        return save_hf_folder(self.model, self.processing_class, folder)


UNSUPPORTED_ARGUMENTS = {
    "data_collator": "reinforge batches and pads (or packs) the rows itself",
    "compute_loss_func": "reinforge's loss is set by the config (loss_type)",
    "compute_metrics": "reinforge logs its own evaluation metrics (val/loss)",
    "preprocess_logits_for_metrics": "reinforge logs its own evaluation metrics (val/loss)",
    "optimizers": "reinforge makes its own AdamW and schedule from the config (learning_rate, lr_scheduler_type, "
                  "adam_beta1...)",
    "optimizer_cls_and_kwargs": "reinforge makes its own AdamW from the config (learning_rate, adam_beta1...)",
    "quantization_config": "reinforge trains unquantised weights (adapters through peft_config)",
    "tools": "reinforge's multi-turn tool runs are set through overrides (rollout.multi_turn)",
    "rollout_func": "reinforge generates with its own engine",
    "environment_factory": "reinforge's multi-turn runs are set through overrides (rollout.multi_turn)",
}
"""TRL trainer arguments reinforge has no counterpart for -> why; given (not None), they are refused in one line."""


def _refuse_unsupported(trainer: str, arguments: dict[str, Any]) -> None:
    for name, value in arguments.items():
        if value is not None and value != (None, None):
            raise TypeError(f"{trainer}({name}=...): {UNSUPPORTED_ARGUMENTS[name]}; remove it")


class GRPOTrainer(_Trainer):
    """GRPO (or any estimator of ``algorithm.adv_estimator``) on a model, a dataset and reward functions; TRL's
    arguments, in TRL's order."""

    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Any = None, optimizers: Any = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: Any = None, rollout_func: Any = None,
                 environment_factory: Any = None, **overrides: Any) -> None:
        from reinforge.config import Config

        _refuse_unsupported("GRPOTrainer", {"optimizers": optimizers, "quantization_config": quantization_config,
                                            "tools": tools, "rollout_func": rollout_func,
                                            "environment_factory": environment_factory})
        if isinstance(args, Config):
            settings = keyword_overrides(overrides)
            output_dir = Path(settings.get("trainer.output_dir", args.trainer.output_dir))
        else:
            args = args if args is not None else GRPOConfig()
            if not isinstance(args, GRPOConfig):
                raise TypeError(f"args must be a GRPOConfig or a reinforge Config; got a {type(args).__name__}")
            settings = args.to_overrides() | keyword_overrides(overrides)
            output_dir = Path(settings.setdefault("trainer.output_dir", "runs/grpo"))
        self.args = args
        inputs = output_dir / "inputs"
        settings = peft_settings(peft_config, model) | settings
        self.reward_functions = reward_functions_of(reward_funcs, settings, inputs, reward_processing_classes)
        settings["model.path"] = save_model_if_loaded(model, processing_class, inputs / "initial_model")
        tokenizer_path = save_tokenizer_if_given(model, processing_class, inputs / "tokenizer")
        if tokenizer_path is not None:
            settings["model.tokenizer_path"] = tokenizer_path
        self.given_model = None if isinstance(model, str | Path) else model
        if train_dataset is not None:
            settings["data.train_files"] = write_dataset(train_dataset, inputs, "train")
        _check_eval_dataset(args, eval_dataset, settings, type(self).__name__)
        if eval_dataset is not None and _evaluates(args):
            settings["data.val_files"] = write_dataset(eval_dataset, inputs, "eval")
        from reinforge.config import config_to_dict
        from reinforge.config.validate import validate_config

        with _named_as_given(args):
            self.config = load_settings(Config, config_to_dict(args) if isinstance(args, Config) else None, settings,
                                        "GRPOTrainer's settings")
            _check_train_data(self.config, type(self).__name__)
            prompt_sets = None
            if (not isinstance(args, Config) and "data.max_prompt_length" not in settings
                    and not self.config.rollout.multi_turn.tool_config_path):
                # TRL keeps every prompt whole: a limit that drops or cuts none (tools' schemas would lengthen them)
                prompt_sets = whole_prompts(self.config)
            validate_config(self.config)
            from reinforge.trainer.rl_trainer import optimizer_steps_per_step

            self._prompt_sets = prompt_sets
            self._given_config = copy.deepcopy(self.config)
            self.trainer = self._make_trainer()
        self.updates = optimizer_steps_per_step(self.config)
        self._start_callbacks(callbacks)

    def _make_trainer(self) -> Any:
        from reinforge.trainer.rl_trainer import RLTrainer

        return RLTrainer(self.config, reward_functions=self.reward_functions, prompt_sets=self._prompt_sets)


class _SupervisedTrainer(_Trainer):
    """A trainer on rows of text (SFT, DPO, reward model): TRL's names in, reinforge's config and trainer out. Each
    subclass takes TRL's arguments in TRL's order and hands them to ``_build``."""

    ARGS: type[Any]
    DEFAULT_OUTPUT_DIR: str
    SCHEMA: str
    """``module:name`` of reinforge's config class of the run."""
    VALIDATE: str
    """``module:name`` of the function that checks that config."""
    TRAINER: str
    """``module:name`` of reinforge's trainer class, built on that config."""

    def _build(self, model: Any, args: Any, train_dataset: Any, eval_dataset: Any, processing_class: Any,
               peft_config: Any, callbacks: Any, unsupported: dict[str, Any], overrides: dict[str, Any]) -> None:
        from reinforge.config import config_to_dict

        _refuse_unsupported(type(self).__name__, unsupported)
        schema = _load(self.SCHEMA)
        if isinstance(args, schema):
            settings = keyword_overrides(overrides)
            settings.setdefault("trainer.output_dir", args.trainer.output_dir)
        else:
            args = args if args is not None else self.ARGS()
            if not isinstance(args, self.ARGS):
                raise TypeError(f"args must be a reinforge.{self.ARGS.__name__}; got a {type(args).__name__}")
            settings = args.to_overrides() | keyword_overrides(overrides)
        self.args = args
        output_dir = Path(settings.setdefault("trainer.output_dir", self.DEFAULT_OUTPUT_DIR))
        inputs = output_dir / "inputs"
        settings = peft_settings(peft_config, model) | settings
        settings["model.path"] = save_model_if_loaded(model, processing_class, inputs / "initial_model")
        tokenizer_path = save_tokenizer_if_given(model, processing_class, inputs / "tokenizer")
        if tokenizer_path is not None:
            settings["model.tokenizer_path"] = tokenizer_path
        self.given_model = None if isinstance(model, str | Path) else model
        self._add_models(settings, processing_class, inputs)
        if train_dataset is not None:
            settings["data.train_files"] = write_dataset(self._rows(train_dataset), inputs, "train")
            if not isinstance(args, schema):
                self._add_row_settings(settings, train_dataset)
        _check_eval_dataset(args, eval_dataset, settings, type(self).__name__)
        if eval_dataset is not None and _evaluates(args):
            settings["data.val_files"] = write_dataset(self._rows(eval_dataset), inputs, "eval")
        with _named_as_given(args):
            self.config = load_settings(schema, config_to_dict(args) if isinstance(args, schema) else None, settings,
                                        f"{type(self).__name__}'s settings")
            _check_train_data(self.config, type(self).__name__)
            _load(self.VALIDATE)(self.config)
            self._given_config = copy.deepcopy(self.config)
            self.trainer = self._make_trainer()
        self._start_callbacks(callbacks)

    def _make_trainer(self) -> Any:
        return _load(self.TRAINER)(self.config)

    def _rows(self, dataset: Any) -> Any:
        return dataset

    def _add_models(self, settings: dict[str, Any], processing_class: Any, inputs: Path) -> None:
        """Settings for models beside the trained one (DPO's reference)."""

    def _add_row_settings(self, settings: dict[str, Any], train_dataset: Any) -> None:
        """Settings that follow from the format of the rows given (SFT's trained tokens)."""


class SFTTrainer(_SupervisedTrainer):
    """Supervised fine-tuning on chat conversations (a ``messages`` column), on ``prompt``/``completion`` pairs, or on
    ``text`` (what ``formatting_func`` makes of each row)."""

    ARGS = SFTConfig
    DEFAULT_OUTPUT_DIR = "runs/sft"
    SCHEMA = "reinforge.config.sft_schema:SFTConfig"
    VALIDATE = "reinforge.config.validate:validate_sft_config"
    TRAINER = "reinforge.trainer.sft_trainer:SFTTrainer"

    def __init__(self, model: Any, args: SFTConfig | Any = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, compute_loss_func: Any = None,
                 compute_metrics: Any = None, callbacks: Any = None, optimizers: Any = (None, None),
                 optimizer_cls_and_kwargs: Any = None, preprocess_logits_for_metrics: Any = None,
                 quantization_config: Any = None, peft_config: Any = None, formatting_func: Any = None,
                 **overrides: Any) -> None:
        """``formatting_func``: TRL's, a function of a row returning its text, which is trained on whole."""
        self.formatting_func = formatting_func
        self._build(model, args, train_dataset, eval_dataset, processing_class, peft_config, callbacks,
                    {"data_collator": data_collator, "compute_loss_func": compute_loss_func,
                     "compute_metrics": compute_metrics, "optimizers": optimizers,
                     "optimizer_cls_and_kwargs": optimizer_cls_and_kwargs,
                     "preprocess_logits_for_metrics": preprocess_logits_for_metrics,
                     "quantization_config": quantization_config}, overrides)

    def _rows(self, dataset: Any) -> Any:
        if self.formatting_func is not None:  # under the column the SFT data reads text from (dataset_text_field)
            key = self.args.data.text_key if hasattr(self.args, "data") else self.args.dataset_text_field or "text"
            return formatted_rows(dataset, self.formatting_func, key)
        return as_conversations(dataset)

    def _add_row_settings(self, settings: dict[str, Any], train_dataset: Any) -> None:
        """data.loss_on as TRL trains the rows: a conversation whole unless assistant_only_loss=True, a
        prompt/completion pair on its completion unless completion_only_loss=False."""
        if "data.loss_on" in settings or self.formatting_func is not None:  # formatted rows are texts
            return
        loss_on = sft_loss_on(first_row(train_dataset), self.args.assistant_only_loss, self.args.completion_only_loss)
        if loss_on is not None:
            settings["data.loss_on"] = loss_on


class DPOTrainer(_SupervisedTrainer):
    """Direct Preference Optimization on ``prompt``/``chosen``/``rejected`` rows (``reinforge dpo``)."""

    ARGS = DPOConfig
    DEFAULT_OUTPUT_DIR = "runs/dpo"
    SCHEMA = "reinforge.config.preference_schema:DPOConfig"
    VALIDATE = "reinforge.config.preference_schema:validate_preference_config"
    TRAINER = "reinforge.trainer.preference.dpo_trainer:DPOTrainer"

    def __init__(self, model: Any, ref_model: Any = None, args: DPOConfig | Any = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 compute_metrics: Any = None, callbacks: Any = None, optimizers: Any = (None, None),
                 quantization_config: Any = None, peft_config: Any = None, **overrides: Any) -> None:
        """``ref_model``: TRL's reference model, a path, hub id or loaded model (``dpo.reference_path``); None: the
        model's starting weights."""
        self.ref_model = ref_model
        self._build(model, args, train_dataset, eval_dataset, processing_class, peft_config, callbacks,
                    {"data_collator": data_collator, "compute_metrics": compute_metrics, "optimizers": optimizers,
                     "quantization_config": quantization_config}, overrides)

    def _add_models(self, settings: dict[str, Any], processing_class: Any, inputs: Path) -> None:
        if self.ref_model is not None:
            settings["dpo.reference_path"] = save_model_if_loaded(self.ref_model, processing_class,
                                                                  inputs / "reference_model")


class RewardTrainer(_SupervisedTrainer):
    """A reward model (Bradley-Terry) on ``chosen``/``rejected`` rows (``reinforge rm``), named as TRL's."""

    ARGS = RewardConfig
    DEFAULT_OUTPUT_DIR = "runs/rm"
    SCHEMA = "reinforge.config.preference_schema:RMConfig"
    VALIDATE = "reinforge.config.preference_schema:validate_preference_config"
    TRAINER = "reinforge.trainer.preference.rm_trainer:RewardModelTrainer"
    MODEL_CLASS = "transformers:AutoModelForSequenceClassification"

    def __init__(self, model: Any, args: RewardConfig | Any = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 compute_metrics: Any = None, callbacks: Any = None, optimizers: Any = (None, None),
                 optimizer_cls_and_kwargs: Any = None, preprocess_logits_for_metrics: Any = None,
                 quantization_config: Any = None, peft_config: Any = None, **overrides: Any) -> None:
        self._build(model, args, train_dataset, eval_dataset, processing_class, peft_config, callbacks,
                    {"data_collator": data_collator, "compute_metrics": compute_metrics, "optimizers": optimizers,
                     "optimizer_cls_and_kwargs": optimizer_cls_and_kwargs,
                     "preprocess_logits_for_metrics": preprocess_logits_for_metrics,
                     "quantization_config": quantization_config}, overrides)

    def _model_class(self) -> Any:
        """The class ``reinforge rm`` trained: a token classifier's own (its score head has a bias), else
        ``MODEL_CLASS``."""
        from reinforge.trainer.preference.rm_trainer import trained_head_class

        return trained_head_class(self.config.model.path, bool(self.config.model.trust_remote_code))

    def _model_options(self) -> dict[str, Any]:
        return super()._model_options() | {"num_labels": 1}
