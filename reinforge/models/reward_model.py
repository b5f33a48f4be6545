"""Loading a reward model: a sequence- or token-classification model with one output.

``check_reward_model`` reads only the folder's ``config.json`` (and the hub's, for a hub id), so
a wrong path, a causal LM or a classifier of several labels is refused in one line before any
weight loads. ``load_reward_model`` then builds the model with the Auto class its config names.
Both heads are called ``score`` in most decoder families of transformers (the token head adds a bias); the token
classifiers of GPT-2, BLOOM, Falcon, MPT and GPT-NeoX call theirs ``classifier`` (``score_head``). The reward worker
reads the head at the last token of each sequence, as verl's reward model does. A sequence classifier reads
it where transformers' class does: at the last token that is not its ``pad_token_id``
(``without_trailing_padding``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PreTrainedModel,
)

from reinforge.models.architectures import config_and_text_config, text_config
from reinforge.models.loading import (
    NO_HUB_KERNELS,
    TOKENIZER_FILES,
    check_model_folder,
    hub_errors_explained,
    is_local_path,
    read_model_config,
)

KEY = "reward.reward_model.model_path"
HEADS = {"ForSequenceClassification": AutoModelForSequenceClassification,
         "ForTokenClassification": AutoModelForTokenClassification}
"""The ending of an architecture's name in config.json and the Auto class that loads it."""


def classifier_auto_class(config) -> type | None:
    """The Auto class (``HEADS``) of the classifier ``config``'s architectures name, None for another model."""
    for name in getattr(config, "architectures", None) or []:
        for ending, auto_class in HEADS.items():
            if name.endswith(ending):
                return auto_class
    return None


def classifier_pad_token_id(config) -> int | None:
    """The pad token a sequence classifier of ``config`` reads its score before: its text config's ``pad_token_id``,
    as transformers' ``*ForSequenceClassification`` reads it (None where it has none)."""
    return getattr(text_config(config), "pad_token_id", None)


def set_classifier_pad_token_id(config, pad_token_id: int) -> None:
    """Give ``config`` and its text config ``pad_token_id``, so a saved classifier pools where it was trained to."""
    for owner in config_and_text_config(config):  # a vision-language classifier (Gemma 3's) pools by its text config
        owner.pad_token_id = pad_token_id


def without_trailing_padding(ids: list[int], pad_token_id: int | None, keep: int = 1) -> list[int]:
    """``ids`` without the tokens at its end that are ``pad_token_id``, ``keep`` tokens at least.

    transformers' ``*ForSequenceClassification`` reads its score at the last token that is not its config's
    pad token, so a sequence ending in that token (an EOS, where a tokenizer without a pad token of its own pads
    with it) is scored at the token before. A causal model's output there does not depend on the tokens after, so
    the sequence without them, scored at its last token, gets the class's own score.
    """
    end = len(ids)
    while pad_token_id is not None and end > keep and ids[end - 1] == pad_token_id:
        end -= 1
    return ids if end == len(ids) else ids[:end]


def score_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The linear layer a one-label classifier's score is read with at a sequence's last token: its ``score``
    (transformers' decoder classifiers), else the ``classifier`` of a token classifier whose family is a decoder
    (``check_score_head``): GPT-2's, BLOOM's, Falcon's, MPT's and GPT-NeoX's apply it to each token's hidden state
    after a dropout that eval mode skips. None for a model without either."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
    return None


def _decoder_token_classifier(model: torch.nn.Module, config, trust_remote_code: bool) -> bool:
    """Whether ``model`` is a token classifier with a linear ``classifier`` of a family whose sequence classifier
    (built from ``config`` on the meta device) reads a linear ``score`` at the last token, as a decoder's does
    (GPT-2's): its last token has seen the whole sequence. An encoder family's (BERT's) pools its first token."""
    if not type(model).__name__.endswith("ForTokenClassification") \
            or not isinstance(getattr(model, "classifier", None), torch.nn.Linear):
        return False
    try:
        with torch.device("meta"):
            sequence_classifier = AutoModelForSequenceClassification.from_config(
                config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 (a family without a sequence classifier: not known to be a decoder)
        return False
    return isinstance(getattr(sequence_classifier, "score", None), torch.nn.Linear)


def check_score_head(auto_class: type, config, key: str, path: str, fix: str,
                     trust_remote_code: bool = False, classifier_heads: bool = False) -> None:
    """Refuse, in one line and before any weight loads, a classifier whose head is not a linear ``score`` that reads
    the last token: an encoder's (BERT's ``classifier`` on its first token), an encoder-decoder's (BART's
    ``classification_head``). ``classifier_heads``: a decoder family's token classifier with a linear ``classifier``
    (GPT-2's) passes too, as the reward worker reads it (``score_head``). ``auto_class`` builds it from ``config`` on the
    meta device; ``key``/``path`` name the setting and ``fix`` ends the line. A class that cannot be built so is left
    to the load."""
    try:
        with torch.device("meta"):
            model = auto_class.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 (the load says what is wrong, in the model's own words)
        return
    if isinstance(getattr(model, "score", None), torch.nn.Linear):
        return
    if classifier_heads and _decoder_token_classifier(model, config, trust_remote_code):
        return
    base = getattr(model, "base_model", None)
    heads = [f"{name}: {type(module).__name__}" for name, module in model.named_children()
             if module is not base and any(True for _ in module.parameters())]
    raise ValueError(f"{key}={path} is a {type(model).__name__} (model_type={config.model_type!r}) whose head "
                     f"({', '.join(heads) or 'inside its base model'}) is not a linear layer named 'score'; reinforge "
                     "reads a reward model's score with that layer at each sequence's last token, as transformers' "
                     "decoder classifiers that have one do (Llama's, Qwen's, Gemma's, GPT-2's sequence classifier, "
                     "...), not where another classifier pools "
                     f"(BERT's first token, BART's last EOS); {fix}")


def _local(path: str) -> str:
    """A local folder checked as a model folder (errors name the reward model's key), or the hub id itself."""
    if not is_local_path(path):
        return path
    try:
        check_model_folder(path)
    except FileNotFoundError as error:
        raise FileNotFoundError(str(error).replace("model.path", KEY) if "model.path" in str(error)
                                else f"{error} ({KEY})") from None
    return str(Path(path).expanduser())


def check_reward_model(path: str, trust_remote_code: bool = False) -> tuple[type, str]:
    """(the Auto class that loads the reward model at ``path``, its model_type); raises ValueError (one line) when
    it is not a classification model with num_labels=1."""
    path = _local(path)
    with hub_errors_explained(path, KEY):
        config = read_model_config(path, trust_remote_code, KEY)
    architectures = list(getattr(config, "architectures", None) or [])
    heads = [(name, auto) for name in architectures for ending, auto in HEADS.items() if name.endswith(ending)]
    if not heads:
        found = ", ".join(architectures) or "no architectures entry"
        raise ValueError(f"{KEY}={path} is not a classification model ({found} in its config.json); the reward "
                         "model must be an AutoModelForSequenceClassification or AutoModelForTokenClassification "
                         "folder with num_labels=1, such as one `reinforge rm` exports; a causal LM that writes its "
                         "judgement (verl's generative reward model) is reward.judge.model_path, with "
                         "reward.judge.template")
    if is_local_path(path) and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{KEY}={path} has no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)}); save "
                         "the reward model's tokenizer beside its weights (tokenizer.save_pretrained)")
    if config.num_labels != 1:
        raise ValueError(f"{KEY}={path} has num_labels={config.num_labels} ({heads[0][0]}); a reward model gives one "
                         "score per sequence: use a model saved with num_labels=1")
    check_score_head(heads[0][1], config, KEY, path, "use a decoder reward model, such as one `reinforge rm` trains "
                     "from a causal LM", trust_remote_code, classifier_heads=True)
    return heads[0][1], str(getattr(config, "model_type", ""))


def load_reward_model(path: str, *, dtype: torch.dtype, device: torch.device | str,
                      trust_remote_code: bool = False) -> PreTrainedModel:
    """The reward model at ``path`` in ``dtype`` on ``device``, use_cache off, in eval mode and frozen."""
    auto_class, _ = check_reward_model(path, trust_remote_code)
    path = _local(path)
    device = torch.device(device)
    placement = {"device_map": {"": device}} if device.type != "cpu" else {}
    with hub_errors_explained(path, KEY):
        model = auto_class.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **placement,
                                           **NO_HUB_KERNELS)
    if not (isinstance(getattr(model, "score", None), torch.nn.Linear)  # what the meta-device check could not build
            or _decoder_token_classifier(model, model.config, trust_remote_code)):
        raise ValueError(f"{KEY}={path} loads as {type(model).__name__}, whose head is not a linear layer named "
                         "'score' (or a decoder token classifier's 'classifier'); reinforge reads reward models of "
                         "transformers' classification classes")
    model.to(device)
    model.config.use_cache = False
    model.eval().requires_grad_(False)
    return model
