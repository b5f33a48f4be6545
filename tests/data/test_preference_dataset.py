"""Preference pairs: TRL's four row shapes, margins, one-line errors naming the row and column, the pair layout."""

from __future__ import annotations

import json

import pytest

from reinforge.data.preference_dataset import (
    PreferenceDataset,
    PreferenceKeys,
    check_preference_rows,
    collate_pairs,
    tokenize_pair,
)
from reinforge.models import build_char_tokenizer

KEYS = PreferenceKeys()
CONVERSATION_PAIR = {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
                     "rejected": [{"role": "assistant", "content": "b"}]}


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def text(tokenizer, ids):
    return tokenizer.decode(ids)


def test_explicit_plain_pair_appends_eos_to_each_completion(tokenizer):
    pair = tokenize_pair(tokenizer, {"prompt": "Q:", "chosen": " yes", "rejected": " no", "margin": 1.5}, KEYS)
    assert text(tokenizer, pair.prompt_ids) == "Q:"
    assert text(tokenizer, pair.chosen_ids) == " yes<|im_end|>" and text(tokenizer, pair.rejected_ids) == " no<|im_end|>"
    assert pair.margin == 1.5


def test_plain_text_is_tokenized_with_the_bos_the_tokenizer_adds_to_any_text():
    """A Llama-like tokenizer adds a BOS to any text: TRL, reinforge sft and the RL prompts keep it, and so do the
    pairs' prompts (the completions follow them, without one)."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = build_char_tokenizer()
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A",
                                                                    special_tokens=[("<|im_start|>", 1)])
    explicit = tokenize_pair(tokenizer, {"prompt": "Q:", "chosen": " yes", "rejected": " no"}, KEYS, need_prompt=True)
    assert explicit.prompt_ids == [1, *tokenizer.encode("Q:", add_special_tokens=False)]
    assert text(tokenizer, explicit.chosen_ids) == " yes<|im_end|>"
    implicit = tokenize_pair(tokenizer, {"chosen": "Q: yes", "rejected": "Q: no"}, KEYS, need_prompt=True)
    assert implicit.prompt_ids == [1, *tokenizer.encode("Q: ", add_special_tokens=False)]
    assert text(tokenizer, implicit.chosen_ids) == "yes<|im_end|>"
    # an empty prompt is the BOS alone, which the completions' first tokens follow
    assert tokenize_pair(tokenizer, {"prompt": "", "chosen": "a", "rejected": "b"}, KEYS, need_prompt=True).prompt_ids == [1]


def test_explicit_conversational_pair_renders_the_prompt_with_the_generation_prompt(tokenizer):
    row = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "yes"}],
           "rejected": [{"role": "assistant", "content": "no"}]}
    pair = tokenize_pair(tokenizer, row, KEYS)
    assert text(tokenizer, pair.prompt_ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert text(tokenizer, pair.chosen_ids) == "yes<|im_end|>\n"
    assert text(tokenizer, pair.rejected_ids) == "no<|im_end|>\n"


def test_a_completion_that_does_not_start_with_the_assistant_is_refused_naming_its_role(tokenizer):
    row = {**CONVERSATION_PAIR, "chosen": [{"role": "user", "content": "yes"}]}
    with pytest.raises(ValueError, match="'chosen' starts with a 'user' message after the prompt; a completion is the "
                                         "assistant's reply"):
        tokenize_pair(tokenizer, row, KEYS)


@pytest.mark.parametrize("as_text", [False, True])
def test_a_tools_column_goes_to_the_chat_template_as_trl_passes_it(as_text):
    from reinforge.models.tiny import TOOL_CHAT_TEMPLATE

    tokenizer = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    row = {"prompt": [{"role": "user", "content": "1+2?"}], "chosen": [{"role": "assistant", "content": "3"}],
           "rejected": [{"role": "assistant", "content": "4"}], "tools": json.dumps(tools) if as_text else tools}
    pair = tokenize_pair(tokenizer, row, KEYS)
    expected = tokenizer.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True, tokenize=False)
    assert text(tokenizer, pair.prompt_ids) == expected and '"name": "add"' in expected
    assert text(tokenizer, pair.chosen_ids) == "3<|im_end|>\n"


def test_implicit_conversational_pair_takes_the_common_leading_messages_as_prompt(tokenizer):
    user = {"role": "user", "content": "hi"}
    explicit = tokenize_pair(tokenizer, {"prompt": [user], "chosen": [{"role": "assistant", "content": "yes"}],
                                         "rejected": [{"role": "assistant", "content": "no"}]}, KEYS)
    implicit = tokenize_pair(tokenizer, {"chosen": [user, {"role": "assistant", "content": "yes"}],
                                         "rejected": [user, {"role": "assistant", "content": "no"}]}, KEYS)
    assert implicit == explicit


def test_a_text_prompt_beside_whole_conversations_is_left_aside_for_their_common_messages(tmp_path, tokenizer):
    """HuggingFaceH4/ultrafeedback_binarized: the question as text in 'prompt', and again as the first message of
    'chosen' and 'rejected'; TRL's maybe_extract_prompt takes the prompt from the conversations."""
    user = {"role": "user", "content": "hi"}
    implicit = {"chosen": [user, {"role": "assistant", "content": "yes"}],
                "rejected": [user, {"role": "assistant", "content": "no"}]}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "hi", **implicit, "score_chosen": 8.0, "score_rejected": 3.0}) + "\n")
    dataset = PreferenceDataset([path], tokenizer, max_length=64, need_prompt=True)
    assert dataset.pairs == [tokenize_pair(tokenizer, implicit, KEYS)]


def test_implicit_plain_pair_shares_its_common_leading_tokens(tokenizer):
    pair = tokenize_pair(tokenizer, {"chosen": "Q: yes", "rejected": "Q: no"}, KEYS)
    assert text(tokenizer, pair.prompt_ids) == "Q: "
    assert text(tokenizer, pair.chosen_ids) == "yes<|im_end|>"
    unrelated = tokenize_pair(tokenizer, {"chosen": "abc", "rejected": "xyz"}, KEYS)
    assert unrelated.prompt_ids == []  # a reward model scores two whole texts
    with pytest.raises(ValueError, match="share no beginning, so there is no prompt"):
        tokenize_pair(tokenizer, {"chosen": "abc", "rejected": "xyz"}, KEYS, need_prompt=True)  # DPO


@pytest.mark.parametrize("row", [{"prompt": "Q", "chosen": "x", "rejected": "x<|im_end|>"},
                                 {"chosen": "Q: x<|im_end|>", "rejected": "Q: x"}])
def test_a_pair_whose_completions_tokenize_the_same_is_refused(tokenizer, row):
    with pytest.raises(ValueError, match=r"^'chosen' and 'rejected' are the same \d token\(s\) once tokenized, which "
                                         r"teaches no preference; drop the row$"):
        tokenize_pair(tokenizer, row, KEYS)


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "Q", "chosen": "a"}, "row 0 of F has no 'rejected' column (its columns: chosen, prompt)"),
    ({"prompt": "Q", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]},
     "row 0 of F: 'rejected' is list while 'chosen' is a string"),
    ({"prompt": "Q", "chosen": "a", "rejected": ""}, "row 0 of F: 'rejected' is an empty string"),
    ({"prompt": "Q", "chosen": None, "rejected": "b"}, "row 0 of F: 'chosen' is empty (null); give the completion as "
     "text or as a list of chat messages, or drop the row"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": {"role": "assistant", "content": "a"},
      "rejected": [{"role": "assistant", "content": "b"}]}, "row 0 of F: 'chosen' is dict \"{'role': 'assistant', "
     "'content': 'a'}\"; give the completion as text or as a list of chat messages, or drop the row"),
    ({"prompt": "Q", "chosen": "a", "rejected": "a"}, "row 0 of F: 'chosen' and 'rejected' are the same"),
    ({"prompt": [], "chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant",
                                                                                   "content": "b"}]},
     "row 0 of F: 'prompt' is an empty list of messages; give the prompt's turns"),
    ({"prompt": "Q", "chosen": "a", "rejected": "b", "margin": "big"}, "row 0 of F: 'margin' is 'big'"),
    ({"prompt": "Q", "chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant",
                                                                                      "content": "b"}]},
     "row 0 of F: 'prompt' is text while 'chosen' and 'rejected' are chat messages that share no leading message; "
     "give the prompt as a list of messages ([{'role': 'user', 'content': ...}])"),
    ({"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "r"}]},
     "row 0 of F: 'chosen' and 'rejected' share no leading message, so there is no prompt"),
    ({"chosen": [{"role": "assistant", "content": 3}], "rejected": [{"role": "assistant", "content": "b"}]},
     "message 0 (assistant) of 'chosen' of row 0 of F has a 'content' of type int"),
    ({"prompt": "<image>What color?", "chosen": "red", "rejected": "blue", "images": ["picture.png"]},
     "row 0 of F has 1 image(s) in its 'images' column; reinforge rm and dpo train on text alone"),
    ({**CONVERSATION_PAIR, "tools": "calc"},
     "row 0 of F has a 'tools' column that is not valid JSON (Expecting value); give a list of function schemas"),
    ({**CONVERSATION_PAIR, "tools": {"name": "calc"}},
     "row 0 of F has a 'tools' column of type dict; give a list of function schemas"),
    ({**CONVERSATION_PAIR, "tools": ["calc"]},
     "row 0 of F has a 'tools' column of type list holding a str; give a list of function schemas"),
])
def test_malformed_rows_are_refused_in_one_line_naming_the_row_and_column(tmp_path, row, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "Q", "chosen": "a", "rejected": "b"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError) as error:
        check_preference_rows([str(path)], KEYS, "train")
    assert message.replace("row 0 of F", f"row 1 of {path}") in str(error.value)
    assert "\n" not in str(error.value)


def test_dataset_drops_pairs_over_max_length_or_refuses_them(tmp_path, tokenizer, caplog):
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "Q:", "chosen": " yes", "rejected": " no"}, {"prompt": "Q:", "chosen": " y" * 30, "rejected": "n"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = PreferenceDataset([path], tokenizer, max_length=16)
    assert len(dataset) == 1 and dataset.num_dropped == 1
    [warning] = [record for record in caplog.records if record.levelname == "WARNING"]  # rows lost are said aloud
    assert warning.getMessage().startswith("train data: 1 of 2 pairs dropped for being longer than data.max_length=16")
    with pytest.raises(ValueError, match=f"row 1 of {path} has 63 tokens .* more than data.max_length=16"):
        PreferenceDataset([path], tokenizer, max_length=16, truncation="error")
    later = tmp_path / "later.jsonl"
    later.write_text("{not json\n")  # a shard a run of max_samples rows does not need
    assert len(PreferenceDataset([path, later], tokenizer, max_length=64, max_samples=2)) == 2


def test_a_pair_is_two_rows_with_one_prompt(tokenizer):
    pairs = [tokenize_pair(tokenizer, {"prompt": "Q:", "chosen": "yes", "rejected": "no", "margin": 2.0}, KEYS),
             tokenize_pair(tokenizer, {"prompt": "Long Q:", "chosen": "a", "rejected": "bb"}, KEYS)]
    batch = collate_pairs(pairs, [7, 3], pad_token_id=tokenizer.pad_token_id)
    assert batch["prompts"].shape == (4, 7) and batch["responses"].shape == (4, 4)
    assert batch["pair_index"].tolist() == [7, 7, 3, 3] and batch["margin"].tolist() == [2.0, 2.0, 0.0, 0.0]
    assert batch["response_mask"].sum(-1).tolist() == [4, 3, 2, 3]
    assert text(tokenizer, batch["input_ids"][1][batch["attention_mask"][1].bool()]) == "Q:no<|im_end|>"
    assert batch["position_ids"][0].tolist()[-4:] == [2, 3, 4, 5]


def test_a_peeked_batch_is_the_next_one_and_the_loader_does_not_advance():
    import torch

    from reinforge.data.preference_dataset import PairLoader, PreferencePair

    pairs = [PreferencePair([1, 2], [3 + index], [4]) for index in range(5)]
    loader, plain = PairLoader(pairs, 2, 0, seed=3), PairLoader(pairs, 2, 0, seed=3)
    for step in range(7):  # three batches an epoch: across two epoch boundaries
        state = loader.state_dict()
        peeked = loader.peek_batch() if step % 2 == 0 else None
        assert loader.state_dict() == state
        batch = loader.next_batch()
        assert peeked is None or peeked is batch
        assert torch.equal(batch["pair_index"], plain.next_batch()["pair_index"])
        assert loader.state_dict() == plain.state_dict()
    loader.peek_batch()
    loader.load_state_dict({"epoch": 0, "position": 0})  # a resumed loader never returns what was peeked before
    assert torch.equal(loader.next_batch()["pair_index"], PairLoader(pairs, 2, 0, seed=3).next_batch()["pair_index"])
    # pairs the data files no longer give (changed in place since the checkpoint) are refused, not resumed into
    with pytest.raises(ValueError, match=r"^the checkpoint's data had 5 pairs but this run's has 4: the data files "):
        PairLoader(pairs[:4], 2, 0, seed=3).load_state_dict(loader.state_dict())


def test_a_resume_over_as_many_changed_pairs_warns_that_the_data_changed(caplog):
    from reinforge.data.preference_dataset import PairLoader, PreferenceDataset, PreferencePair, pairs_digest

    pairs = [PreferencePair([1, 2], [3 + index], [4]) for index in range(5)]
    state = PairLoader(pairs, 2, 0, seed=3).state_dict()
    PairLoader(pairs, 2, 0, seed=3).load_state_dict(state)
    assert "data files changed" not in caplog.text
    PairLoader([*pairs[:4], PreferencePair([1, 2], [4], [3])], 2, 0, seed=3).load_state_dict(state)
    assert "the data files changed since the checkpoint was written (the same 5 pairs" in caplog.text
    dataset = PreferenceDataset.__new__(PreferenceDataset)
    dataset.pairs = pairs  # the reference log-probs' fingerprint is the loader's hash of the same pairs
    assert dataset.fingerprint() == pairs_digest(pairs) == state["data_digest"]
