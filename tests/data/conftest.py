"""A byte-level tokenizer with a chat template, built in code: every ASCII character is one token."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<eos>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tiny_tokenizer(chat_template: str | None = CHAT_TEMPLATE, pad_token: str | None = "<pad>"):
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token=pad_token)
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def make_tiny_tokenizer():
    """build_tiny_tokenizer itself, for tests that need another chat template or no pad token."""
    return build_tiny_tokenizer
