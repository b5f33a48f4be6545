"""The PPO critic: a causal LM's transformer body with a scalar value head on every position.

The body is the LM without its vocabulary projection (``AutoModel``; the causal LM's own base model where
``AutoModel`` builds another, BART's encoder-decoder for its decoder-only causal LM), so a critic starts from
the same weights as the actor. The head is a float32 Linear(hidden, 1) with small random
weights (not zeros, so the body gets gradient from the first step) drawn from a fixed seed,
so every rank builds the same head. A saved critic is an HF folder of the body plus
``value_head.safetensors``; from_pretrained reads either that or a plain causal LM folder.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

from reinforge.models.export import atomic_folder
from reinforge.models.loading import (
    _ANSI,
    NO_HUB_KERNELS,
    HeldLoadReport,
    _mismatched_weights,
    attention_for,
    check_model_folder,
    enable_gradient_checkpointing,
    hub_errors_explained,
    is_local_path,
    mismatched_weight_shapes,
    read_model_config,
    tokens_its_tokenizer_moves,
    vocab_rows,
)

VALUE_HEAD_FILE = "value_head.safetensors"


def build_value_head(hidden_size: int, seed: int = 0) -> nn.Linear:
    """Linear(hidden_size, 1) in float32, weights ~ N(0, 1/(hidden_size + 1)), bias 0."""
    head = nn.Linear(hidden_size, 1, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.normal_(0.0, (hidden_size + 1) ** -0.5, generator=generator)
        head.bias.zero_()
    return head


def output_width(backbone: nn.Module) -> int:
    """The width of the body's last hidden state: its token embeddings' (the width the LM head reads, tied or not;
    OPT projects its hidden size out to it), else ``hidden_size``."""
    try:
        embeddings = backbone.get_input_embeddings() if hasattr(backbone, "get_input_embeddings") else None
    except NotImplementedError:  # a wrapper that only holds its decoder (BART's causal LM body)
        embeddings = None
    width = getattr(embeddings, "embedding_dim", None)
    return int(width) if isinstance(width, int) and width > 0 else int(backbone.config.hidden_size)


def body_outside_auto_model(config) -> bool:
    """Whether the causal LM of ``config`` reads its head from a body of another class than ``AutoModel`` builds:
    BART's (mBART's, Pegasus', ...) causal LM is a decoder alone, ``AutoModel`` the encoder-decoder, which would read
    each sequence through a fresh encoder and with its tokens shifted one place right. Built on the meta device."""
    causal_lm_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if causal_lm_class is None:
        return False
    try:
        with torch.device("meta"):
            body = causal_lm_class(config).base_model
    except Exception:  # noqa: BLE001 (a class that cannot be built so loads as AutoModel, as before)
        return False
    return type(body) is not MODEL_MAPPING.get(type(config), None)


def shapes_refused(path: str, key: str, mismatch: str) -> str:
    return (f"{key}={path}: its weights do not fit its config.json ({mismatch}); fix config.json's sizes to the "
            f"weights', or point {key} at the folder they came with")


def only_unused_weights(report: HeldLoadReport) -> bool:
    """Whether the held load reports list only weights the model does not use (``UNEXPECTED``: a causal LM's output
    layer read for its body), none missing or of another shape."""
    statuses = [row.split("|")[1].strip() for record in report.records
                for row in _ANSI.sub("", record.getMessage()).splitlines()[2:] if row.count("|") >= 2]
    return all(status == "UNEXPECTED" for status in statuses)


def check_critic_folder(path: str, key: str = "critic.model_path", trust_remote_code: bool = False) -> None:
    """Refuse, in one line naming ``key`` and before any model loads, a local critic folder that would not load
    whole: one ``check_model_folder`` refuses (missing, half-written, cut-off or garbage safetensors), or whose
    safetensors weights have other shapes than its config.json builds. A folder without a causal LM's output layer
    is a critic's as well as any: the value head replaces that layer."""
    check_model_folder(path, key)
    mismatch = mismatched_weight_shapes(path, trust_remote_code)
    if mismatch is not None:
        raise ValueError(shapes_refused(str(Path(path).expanduser()), key, mismatch))


def check_critic_reads_policy_ids(path: str, policy_tokenizer, key: str = "critic.model_path",
                                  trust_remote_code: bool = False, policy_rows: int | None = None) -> None:
    """The critic reads the policy's token ids as they are: refuse (one line naming ``key``) a local critic folder
    whose tokenizer gives any of the policy's tokens another id or none, or whose embedding has fewer rows than the
    ids the policy reads and writes (its tokenizer's, within the policy's own ``policy_rows``): the critic's lookup
    failed on the first id past them, after a rollout."""
    moved = tokens_its_tokenizer_moves(path, policy_tokenizer, trust_remote_code)
    if moved:
        raise ValueError(f"{key}={path}: the critic reads the policy's token ids, but {len(moved)} of the "
                         f"policy's {len(policy_tokenizer.get_vocab())} tokens (first {moved[0]!r}) have another "
                         "id or none in its tokenizer; point it at a model of the policy's tokenizer, or unset it "
                         "to start the critic from model.path")
    ids = len(policy_tokenizer) if policy_rows is None else min(len(policy_tokenizer), policy_rows)
    rows = vocab_rows(str(Path(path).expanduser()), trust_remote_code, key)
    if rows is not None and rows < ids:
        raise ValueError(f"{key}={path}: the critic reads the policy's token ids, {ids} of them, but its embedding "
                         f"has {rows} rows (vocab_size in its config.json); point it at a model of the policy's "
                         "vocabulary, or unset it to start the critic from model.path")


class ValueModel(nn.Module):
    def __init__(self, backbone: PreTrainedModel, value_head: nn.Linear | None = None, seed: int = 0):
        super().__init__()
        self.backbone = backbone
        self.value_head = value_head if value_head is not None else build_value_head(output_width(backbone), seed)

    @property
    def config(self):
        return self.backbone.config

    def get_decoder(self) -> nn.Module:
        """The backbone's decoder (a vision-language backbone's language model), so that ``engine.fsdp.
        decoder_layers`` shards the language model's layers, not a vision tower's blocks that come first (Gemma 3's
        SigLIP ``encoder.layers`` before ``language_model.layers``)."""
        decoder = self.backbone.get_decoder() if hasattr(self.backbone, "get_decoder") else None
        return decoder if isinstance(decoder, nn.Module) else self.backbone

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        """Values, float32 (batch, seq_len), for input_ids (batch, seq_len): one per position."""
        outputs = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=False)
        hidden_states = outputs.last_hidden_state.to(self.value_head.weight.dtype)
        return self.value_head(hidden_states).squeeze(-1).float()

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu", trust_remote_code: bool = False,
                        attn_implementation: str = "sdpa", gradient_checkpointing: bool = False,
                        seed: int = 0, key: str = "critic.model_path") -> ValueModel:
        """A critic from a causal LM folder (new head) or a folder written by save_pretrained (its head); ``key``
        is the setting that gave ``path``, for the one-line refusals of a folder that cannot load (those of
        ``check_critic_folder``, and of weights of other shapes than its config.json builds)."""
        path = str(path)
        head_path = None
        if is_local_path(path):
            check_critic_folder(path, key, trust_remote_code)
            path = str(Path(path).expanduser())
            if (Path(path) / VALUE_HEAD_FILE).is_file():
                head_path = Path(path) / VALUE_HEAD_FILE
        with hub_errors_explained(path, key):
            causal_body = body_outside_auto_model(read_model_config(path, trust_remote_code, key))
            attn_implementation = attention_for(path, trust_remote_code, attn_implementation,
                                                MODEL_FOR_CAUSAL_LM_MAPPING if causal_body else MODEL_MAPPING)
            try:
                with HeldLoadReport() as report:
                    if causal_body:  # the causal LM's body, its head dropped; saved, it reloads the same way
                        backbone = AutoModelForCausalLM.from_pretrained(
                            path, dtype=dtype, trust_remote_code=trust_remote_code,
                            attn_implementation=attn_implementation, **NO_HUB_KERNELS).base_model
                    else:
                        backbone = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                             attn_implementation=attn_implementation, **NO_HUB_KERNELS)
            except RuntimeError as error:  # weights the headers could not show up front (.bin files)
                mismatch = _mismatched_weights(report)
                if mismatch is None or "ignore_mismatched_sizes" not in str(error):
                    report.release()
                    raise
                raise ValueError(shapes_refused(path, key, mismatch)) from None
            if not only_unused_weights(report):  # the causal LM's head, which the body leaves out, goes unsaid
                report.release()
        backbone.config.use_cache = False
        value_head = build_value_head(output_width(backbone), seed)
        if head_path is not None:
            value_head.load_state_dict(load_file(head_path))
        model = cls(backbone, value_head).to(device)
        if gradient_checkpointing:
            enable_gradient_checkpointing(backbone)
        return model

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write the body as an HF folder and the head as value_head.safetensors, atomically; returns out_dir."""
        with atomic_folder(out_dir) as staging:
            self.backbone.save_pretrained(staging)
            head_state = {name: tensor.detach().cpu().contiguous() for name, tensor in self.value_head.state_dict().items()}
            save_file(head_state, staging / VALUE_HEAD_FILE, metadata={"format": "pt"})
        return Path(out_dir)
