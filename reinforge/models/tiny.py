"""Tiny models of standard transformers architectures and a character tokenizer, built in code.

Tests and the CPU demo need real models of every family reinforge runs (``models.architectures``)
and a real chat tokenizer, but no hub download. ``build_tiny_causal_lm`` builds any of them with
few layers, hidden size 64 and each family's differences switched on where transformers leaves
them off by default: soft-caps small enough to bind (Gemma 2 and 3), partial rotary (Phi-3),
NoPE layers (SmolLM3), 4 to 8 experts of top-2 routing, DeepSeek's low-rank MLA, group-limited
routing, shared experts and a first dense layer; ``sliding_window`` turns each family's windows on.
The tokenizer It is byte-level BPE with no merges: every ASCII character (letters,
digits, punctuation, space, newline) is one token, any other character is its UTF-8 bytes,
and ``decode(encode(text))`` gives ``text`` back exactly. Its special tokens follow Qwen's ChatML:

- ``<|endoftext|>`` is the pad token;
- ``<|im_start|>`` opens a turn, ``<|im_end|>`` closes it and is the EOS token, so generation
  stops where the assistant's turn ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

from reinforge.models.export import save_hf_folder

PAD_TOKEN = "<|endoftext|>"
TURN_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, TURN_START_TOKEN, EOS_TOKEN)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message."""

TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '"
    " '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": '"
    " '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- elif message.role == 'assistant' %}"
    "{{ '<|im_start|>assistant' }}{% if message.content %}{{ '\\n' + message.content }}{% endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{ call.function.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML with Hermes tool calls, shaped like Qwen2.5's template: tool schemas in the system turn,
calls as ``<tool_call>`` JSON in the assistant turn, consecutive tool messages in one user turn
of ``<tool_response>`` blocks."""

TINY_SOFTCAPS = {"attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0}
"""Gemma's soft-caps in tiny models: small enough that tanh bends the scores and logits of a random model."""

_MOE_ROUTING = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
_MLA = {"kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "n_group": 4, "topk_group": 2, "n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
        **_MOE_ROUTING}

FAMILY_OPTIONS: dict[str, dict] = {
    "qwen2": {},
    "llama": {},
    "mistral": {},
    "qwen3": {"head_dim": 16},
    "gemma2": {**TINY_SOFTCAPS, "head_dim": 16, "query_pre_attn_scalar": 16},
    "gemma3_text": {**TINY_SOFTCAPS, "head_dim": 16, "query_pre_attn_scalar": 16},
    "phi3": {"partial_rotary_factor": 0.5},
    "olmo2": {},
    "smollm3": {"no_rope_layer_interval": 2},
    "qwen3_moe": {"num_experts": 4, "head_dim": 16, "decoder_sparse_step": 1, "norm_topk_prob": True,
                  **_MOE_ROUTING},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False},
    "deepseek_v2": {**_MLA, "q_lora_rank": None, "topk_method": "group_limited_greedy",
                    "routed_scaling_factor": 1.5},
    "deepseek_v3": {**_MLA, "q_lora_rank": 24, "routed_scaling_factor": 2.5},
    "gpt_neox": {},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
    "phimoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "intermediate_size": 32,
                "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
}
"""model_type -> its tiny options beyond the shared shape: the families of ``models.architectures``, and causal LMs
outside the table (they train through transformers' own modules): ``gpt_neox``, ``qwen2_moe`` and ``phimoe``
(windows only in their masks) and ``gpt_oss`` (attention sinks, windows on even layers)."""

ARCHITECTURES = tuple(FAMILY_OPTIONS)


def _window_options(model_type: str, sliding_window: int | None, num_layers: int) -> dict:
    """Config keys that turn each family's windows on (W keys including the query), or keep them off."""
    if model_type in ("qwen2", "qwen3"):  # windows from layer max_window_layers on; the first layer stays full
        return {"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": 1} \
            if sliding_window else {}
    if model_type == "qwen2_moe":  # windows on even layers below max_window_layers
        return {"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": num_layers} \
            if sliding_window else {}
    if model_type in ("qwen3_moe", "smollm3"):
        return {"use_sliding_window": True, "sliding_window": sliding_window} if sliding_window else {}
    if model_type in ("gemma2", "gpt_oss"):  # even layers slide
        return {"sliding_window": sliding_window or 4096}
    if model_type == "gemma3_text":  # one full layer in two (the real models keep one in six)
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        return {"sliding_window": sliding_window or 4096, "layer_types": layer_types}
    if model_type in ("mistral", "mixtral", "phi3", "phimoe"):
        return {"sliding_window": sliding_window}
    if sliding_window:
        raise ValueError(f"tiny {model_type} models have no sliding window; leave sliding_window unset")
    return {}


def tiny_config(arch: str = "qwen2", vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 2,
                num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                max_position_embeddings: int = 512, tie_word_embeddings: bool = True,
                pad_token_id: int | None = None, eos_token_id: int | None = None,
                sliding_window: int | None = None, **overrides) -> PretrainedConfig:
    """The config of a tiny ``arch`` model (a key of ``FAMILY_OPTIONS``); ``overrides`` replace any key."""
    if arch not in FAMILY_OPTIONS:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
    options = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                   num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                   intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
                   tie_word_embeddings=tie_word_embeddings, pad_token_id=pad_token_id, bos_token_id=None,
                   eos_token_id=eos_token_id)
    options.update(FAMILY_OPTIONS[arch])
    if arch.startswith("deepseek"):  # MLA expands the latent into keys and values for every query head
        options["num_key_value_heads"] = num_heads
    options.update(_window_options(arch, sliding_window, num_layers))
    options.update(overrides)
    return AutoConfig.for_model(arch, **options)


def byte_symbols() -> list[str]:
    """The printable character that stands for each byte value in a byte-level BPE vocab (GPT-2's mapping).

    Printable ASCII and Latin-1 bytes stand for themselves; the others (space, newline, control
    bytes) are moved to code points from 256 on, so that space is "Ġ" and newline "Ċ".
    """
    stands_for_itself = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols: dict[int, str] = {byte: chr(byte) for byte in stands_for_itself}
    moved = (byte for byte in range(256) if byte not in symbols)
    for offset, byte in enumerate(moved):
        symbols[byte] = chr(256 + offset)
    return [symbols[byte] for byte in range(256)]


def build_char_tokenizer(extra_tokens: Sequence[str] = (), chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A byte-level ChatML tokenizer without merges: one token per ASCII character, per byte otherwise.

    Ids: the three special tokens 0-2, then byte b at id 3 + b (so "a" is 100), then ``extra_tokens``
    (e.g. ``<think>``), one id each.
    """
    vocab = {token: token_id for token_id, token in enumerate(SPECIAL_TOKENS)}
    for symbol in byte_symbols():
        vocab[symbol] = len(vocab)
    # Byte-level rather than a plain character vocab: transformers 5 loads a folder whose config says
    # qwen2 with its Qwen2Tokenizer, which rebuilds a byte-level pipeline around our vocab.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in extra_tokens])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                   padding_side="left", chat_template=chat_template)


def build_tiny_causal_lm(arch: str = "qwen2", vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 2,
                         num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                         max_position_embeddings: int = 512, tie_word_embeddings: bool = True,
                         seed: int = 0, pad_token_id: int | None = None,
                         eos_token_id: int | None = None, sliding_window: int | None = None,
                         **overrides) -> PreTrainedModel:
    """A randomly initialised float32 causal LM of ``arch`` (see ``tiny_config``); the global RNG is left untouched."""
    config = tiny_config(arch, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                         max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                         pad_token_id=pad_token_id, eos_token_id=eos_token_id, sliding_window=sliding_window,
                         **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    if eos_token_id is not None:
        model.generation_config.eos_token_id = eos_token_id
        model.generation_config.pad_token_id = pad_token_id
    return model.float()


def save_tiny_model(out_dir: str | Path, arch: str = "qwen2", extra_tokens: Sequence[str] = (), seed: int = 0,
                    **model_kwargs) -> Path:
    """Save a tiny model and the char tokenizer into ``out_dir``, loadable by the Auto classes; returns the folder.

    ``model_kwargs`` go to build_tiny_causal_lm; the vocab size is always the tokenizer's.
    """
    tokenizer = build_char_tokenizer(extra_tokens)
    model = build_tiny_causal_lm(arch, vocab_size=len(tokenizer), seed=seed, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id, **model_kwargs)
    return save_hf_folder(model, tokenizer, out_dir)

