import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, Qwen2ForCausalLM

from reinforge.models import build_char_tokenizer, build_tiny_causal_lm, save_tiny_model

TEXTS = ["Hello, world!", "  two  spaces\nand a newline\n", "x = 12 + 30 * (4 - 1)\t# tab", "~`!@#$%^&*()_-+={}[]|\\:;\"'<>,.?/",
         "naïve café: 3€ 😀", ""]


@pytest.mark.parametrize("arch, model_class", [("qwen2", Qwen2ForCausalLM), ("llama", LlamaForCausalLM)])
def test_tiny_model_forward(arch, model_class):
    model = build_tiny_causal_lm(arch, vocab_size=100, hidden_size=32, num_heads=4, num_kv_heads=2)
    assert isinstance(model, model_class)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    logits = model(input_ids=torch.randint(0, 100, (2, 7))).logits
    assert logits.shape == (2, 7, 100)
    assert logits.dtype == torch.float32


def test_tiny_model_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = build_tiny_causal_lm("qwen2", vocab_size=50, seed=7)
    assert torch.equal(torch.rand(3), expected)
    second = build_tiny_causal_lm("qwen2", vocab_size=50, seed=7)
    third = build_tiny_causal_lm("qwen2", vocab_size=50, seed=8)
    assert torch.equal(first.lm_head.weight, second.lm_head.weight)
    assert not torch.equal(first.lm_head.weight, third.lm_head.weight)


def test_unknown_architecture_lists_known_ones():
    with pytest.raises(ValueError, match="qwen2, llama"):
        build_tiny_causal_lm("gpt9", vocab_size=10)


@pytest.mark.parametrize("text", TEXTS)
def test_char_tokenizer_round_trips_text(text):
    tokenizer = build_char_tokenizer()
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(token_ids) == text
    if text.isascii():
        assert len(token_ids) == len(text)


def test_char_tokenizer_special_tokens_and_extras():
    tokenizer = build_char_tokenizer(extra_tokens=["<think>", "</think>"])
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.padding_side == "left"
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.convert_tokens_to_ids("a") == 3 + ord("a")
    text = "<think>hmm</think>42<|im_end|>"
    token_ids = tokenizer(text)["input_ids"]
    assert len(token_ids) == 1 + 3 + 1 + 2 + 1
    assert tokenizer.decode(token_ids) == text
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == "<think>hmm</think>42"


def test_chat_template_is_chatml():
    tokenizer = build_char_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": "2"}]
    text = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert full.endswith("<|im_start|>assistant\n2<|im_end|>\n")


def test_saved_tiny_model_loads_with_auto_classes(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    for text in TEXTS:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.padding_side == "left"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    batch = tokenizer(["ab", "abcd"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, :2].tolist() == [tokenizer.pad_token_id] * 2
    assert model(**batch).logits.shape == (2, 4, len(tokenizer))


def test_save_tiny_model_passes_model_options(tmp_path):
    folder = save_tiny_model(tmp_path / "m", arch="llama", num_layers=1, tie_word_embeddings=False,
                             extra_tokens=["<tool_call>"])
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.num_hidden_layers == 1
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    assert model.config.vocab_size == 3 + 256 + 1
