"""The SFT trainer's checks of data and settings: odd roles and contents, an assistant turn first, truncated
conversations, the trained chat template kept in the checkpoint, settings a resume may not change."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from reinforge.config import load_sft_config
from reinforge.data.sft_dataset import SFTDataset, tokenize_conversation
from reinforge.models import build_char_tokenizer
from reinforge.trainer.sft_trainer import SFTTrainer

sys.path.insert(0, str(Path(__file__).parents[1] / "agent"))
from family_templates import OLMO2, QWEN3  # noqa: E402

PRINTING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Prints ``content`` with ``{{ }}``, as most templates do: a list or a number renders as its repr."""


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def dataset_of(tmp_path, tokenizer, *rows, **options):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return SFTDataset([path], tokenizer, max_length=options.pop("max_length", 64),
                      chat_template=options.pop("chat_template", PRINTING_TEMPLATE), **options)


def sft_config(tmp_path, model_dir, *extra: str):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{index}+1?"},
                                                      {"role": "assistant", "content": str(index + 1)}]}) + "\n"
                             for index in range(8)))
    return load_sft_config(None, [f"model.path={model_dir}", f"data.train_files=[{train}]", "data.batch_size=4",
                                  "data.max_length=64", "trainer.device=cpu", "trainer.loggers=[jsonl]",
                                  f"trainer.output_dir={tmp_path / 'run'}", *extra])


GOOD = {"messages": [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "3"}]}


@pytest.mark.parametrize("messages, match", [
    ([{"role": "usr", "content": "hi"}, {"role": "assistant", "content": "yo"}], "message 0 .* role 'usr'"),
    ([{"role": "user", "content": "hi"}, {"role": "Assistant", "content": "yo"}], "message 1 .* role 'Assistant'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}],
     r"message 1 \(assistant\) .* type list"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}], r"message 1 \(assistant\) .* type int"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], "content null and no tool_calls"),
    ([{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
     "starts with an assistant message"),
])
def test_malformed_row_is_refused_naming_row_and_message(tmp_path, tokenizer, messages, match):
    with pytest.raises(ValueError, match=match) as error:
        dataset_of(tmp_path, tokenizer, GOOD, {"messages": messages})
    assert f"row 1 of {tmp_path / 'rows.jsonl'}" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("row", [{"prompt": [{"role": "user", "content": "hi"}], "completion": None},
                                 {"prompt": "1+1=", "completion": None}, {"prompt": None, "completion": "2"}])
def test_a_prompt_completion_row_without_one_of_them_is_refused_naming_the_row(tmp_path, tokenizer, row):
    with pytest.raises(ValueError, match=r"^row 1 of .* has a 'prompt' of type \w+ and a 'completion' of type \w+; a "):
        dataset_of(tmp_path, tokenizer, GOOD, row)


CALL = {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]}
TOOL_ROW = {"messages": [{"role": "user", "content": "hi"}, CALL, {"role": "tool", "content": "1"},
                         {"role": "assistant", "content": "yo"}]}


def test_tool_call_turn_with_null_content_is_trained_on_its_calls(tmp_path, tokenizer):
    """Qwen3's template writes the calls (and leaves the empty <think></think> out of the earlier turn): the call turn
    trains its calls and end of turn, the tool's output stays in the sequence, untrained."""
    (example,) = dataset_of(tmp_path, tokenizer, TOOL_ROW, chat_template=QWEN3, max_length=256).examples
    runs = "".join(tokenizer.decode([token]) if kept else "\0" for token, kept in
                   zip(example.input_ids, example.loss_mask, strict=True)).split("\0")
    assert [run for run in runs if run] == ['<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>',
                                            "<think>\n\n</think>\n\nyo<|im_end|>"]
    assert "<tool_response>\n1\n</tool_response>" in tokenizer.decode(example.input_ids)


@pytest.mark.parametrize("template, refusal", [
    (PRINTING_TEMPLATE, r"the chat template drops the tool_calls of message 1 \(assistant\): it writes the turn "
                        r"without them.*; set data.chat_template to a template that writes tool calls, or keep rows "
                        r"without tool turns$"),
    (OLMO2, r"the chat template drops message 2 \(tool\): it writes none of its content.*; set data.chat_template "
            r"to a template with a tool role, or keep rows without tool turns$"),
])
def test_a_tool_turn_the_template_drops_is_refused_naming_the_row_and_the_fix(tmp_path, tokenizer, template, refusal):
    """A template that ignores tool_calls would train a call turn on its end of turn alone; one without a tool role
    (OLMo 2's) would leave the tool's output out of the sequence."""
    with pytest.raises(ValueError, match=f"^row 1 of {tmp_path / 'rows.jsonl'}: {refusal}") as refused:
        dataset_of(tmp_path, tokenizer, GOOD, TOOL_ROW, chat_template=template)
    assert "\n" not in str(refused.value)


def test_assistant_first_gives_a_clear_error_not_the_template_s(tokenizer):
    with pytest.raises(ValueError, match="starts with an assistant message"):
        tokenize_conversation(tokenizer, [{"role": "assistant", "content": "hi"}])


def test_truncated_conversations_are_reported(tmp_path, tokenizer, caplog):
    long_row = {"messages": [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "3" * 80}]}
    with caplog.at_level(logging.INFO, logger="reinforge.data.sft_dataset"):
        dataset = dataset_of(tmp_path, tokenizer, GOOD, long_row, truncation="right")
    assert dataset.num_truncated == 1 and dataset.num_dropped == 0
    assert "1 cut to that length" in caplog.text


def test_several_launched_processes_are_refused_before_the_run_folder(tmp_path, tiny_model_dir, monkeypatch):
    """Under torchrun each process would train the whole model alone; the second then found the run folder locked
    by the first and said only that it was in use."""
    from reinforge.config import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^reinforge sft trains in one process, but WORLD_SIZE=2: a launcher "
                                          r"\(torchrun\) started 2 processes"):
        SFTTrainer(sft_config(tmp_path, tiny_model_dir))
    assert not (tmp_path / "run").exists()


def test_checkpoint_carries_the_chat_template_it_was_trained_with(tmp_path, tiny_model_dir):
    trainer = SFTTrainer(sft_config(tmp_path, tiny_model_dir, "trainer.total_steps=1",
                                    f"data.chat_template={json.dumps(PRINTING_TEMPLATE)}"))
    trainer.fit()
    assert AutoTokenizer.from_pretrained(trainer.final_model_dir()).chat_template == PRINTING_TEMPLATE


@pytest.mark.parametrize("setting", ["data.truncation=right", "data.messages_key=conversation", "data.loss_on=all",
                                     f"data.chat_template={json.dumps(PRINTING_TEMPLATE)}"])
def test_resume_refuses_a_change_to_which_rows_are_trained(tmp_path, tiny_model_dir, setting):
    SFTTrainer(sft_config(tmp_path, tiny_model_dir, "trainer.total_steps=1")).fit()
    with pytest.raises(ValueError, match=f"changed settings it cannot take: {setting.split('=')[0]}"):
        SFTTrainer(sft_config(tmp_path, tiny_model_dir, "trainer.total_steps=2", setting))


def test_a_run_refused_while_it_starts_frees_its_folder_at_once(tmp_path, tiny_model_dir, monkeypatch):
    """Refused at resume, or failing after the folder is locked, the run releases the lock before it raises: the
    caller may hold the exception (and with it the trainer) as long as it likes, and the folder is free."""
    from reinforge.trainer import sft_trainer
    from reinforge.trainer.run_folder import RunLock

    SFTTrainer(sft_config(tmp_path, tiny_model_dir, "trainer.total_steps=1")).fit()
    with pytest.raises(ValueError, match="changed settings it cannot take") as refused:
        SFTTrainer(sft_config(tmp_path, tiny_model_dir, "trainer.total_steps=2", "data.truncation=right"))
    RunLock(tmp_path / "run").acquire().release()

    def failing_load(*args, **kwargs):
        raise OSError("the tokenizer's files are unreadable")

    monkeypatch.setattr(sft_trainer, "load_tokenizer", failing_load)
    with pytest.raises(OSError, match="unreadable") as failed:
        SFTTrainer(sft_config(tmp_path, tiny_model_dir, "trainer.total_steps=2"))
    RunLock(tmp_path / "run").acquire().release()
    assert refused.value is not None and failed.value is not None  # both still held here


def test_resume_refuses_data_files_whose_rows_changed_since_the_checkpoint_before_the_model_loads(
        tmp_path, tiny_model_dir, monkeypatch):
    from reinforge.trainer import sft_trainer

    SFTTrainer(sft_config(tmp_path, tiny_model_dir, "trainer.total_steps=1")).fit()
    config = sft_config(tmp_path, tiny_model_dir, "trainer.total_steps=2")
    train = tmp_path / "train.jsonl"
    train.write_text(train.read_text() + json.dumps(GOOD) + "\n")  # the same path, one more row
    loaded = []
    monkeypatch.setattr(sft_trainer, "load_causal_lm", lambda *args, **kwargs: loaded.append(args))
    with pytest.raises(ValueError, match=r"^the checkpoint's SFT data had 8 rows .* but this run's has 9: the data "
                                         r"files changed since"):
        SFTTrainer(config)
    assert loaded == []


def test_resume_over_as_many_changed_rows_warns_that_the_data_changed(tmp_path, tiny_model_dir, caplog):
    SFTTrainer(sft_config(tmp_path, tiny_model_dir, "trainer.total_steps=1")).fit()
    config = sft_config(tmp_path, tiny_model_dir, "trainer.total_steps=2")
    train = tmp_path / "train.jsonl"
    rows = train.read_text().splitlines()
    changed = json.loads(rows[0])
    changed["messages"][-1]["content"] += " and more"
    train.write_text("\n".join([json.dumps(changed), *rows[1:]]) + "\n")  # the same path and count, a row changed
    SFTTrainer(config).fit()
    assert caplog.text.count("the data files changed since the checkpoint was written (the same 8 rows") == 1


def test_max_samples_reached_in_the_first_file_leaves_the_later_ones_unread(tmp_path, tokenizer):
    first, later = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    later.write_text("{not json\n")  # a shard the run does not need
    dataset = SFTDataset([first, later], tokenizer, max_length=64, chat_template=PRINTING_TEMPLATE, max_samples=2)
    assert len(dataset) == 2


def test_messages_stored_as_json_text_are_named_as_such(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"^row 1 of .* has 'messages' as a string \('\[\{.*\), not a list of chat "
                                         r"messages; store the list itself"):
        dataset_of(tmp_path, tokenizer, GOOD, {"messages": json.dumps(GOOD["messages"])})
