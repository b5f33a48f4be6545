import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from reinforge.config.schema import DataConfig
from reinforge.data.files import read_rows
from reinforge.data.rl_dataset import RLDataset

# With the tiny tokenizer, a user message of k ASCII characters becomes k + 3 prompt tokens:
# <|user|> ... <eos> <|assistant|>.
ROWS = [
    {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "1+1?"}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"split": "train", "index": 0}},
    {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "12+30?"}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {"split": "train", "index": 1}},
    {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "100+200+300?"}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "600"}, "extra_info": {"split": "train", "index": 2}},
]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def config(**overrides):
    return DataConfig(**{"max_prompt_length": 64, **overrides})


def test_parquet_jsonl_and_datasets_folder_give_the_same_examples(tmp_path, tiny_tokenizer):
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    sources = [write_parquet(tmp_path / "train.parquet", ROWS), write_jsonl(tmp_path / "train.jsonl", ROWS),
               str(folder)]
    loaded = [RLDataset(source, tiny_tokenizer, config()).examples for source in sources]
    assert loaded[0] == loaded[1] == loaded[2]
    first = loaded[0][0]
    assert first.prompt_ids == tiny_tokenizer("<|user|>1+1?<eos><|assistant|>", add_special_tokens=False)["input_ids"]
    assert len(first.prompt_ids) == 4 + 3
    assert (first.data_source, first.ground_truth, first.ability) == ("arithmetic", "2", "math")
    assert first.extra_info == {"split": "train", "index": 0}
    assert first.raw_prompt == [{"role": "user", "content": "1+1?"}]
    assert [example.index for example in loaded[0]] == [0, 1, 2]


def test_row_indices_continue_across_files(tmp_path, tiny_tokenizer):
    files = [write_jsonl(tmp_path / "a.jsonl", ROWS[:2]), write_jsonl(tmp_path / "b.jsonl", ROWS)]
    dataset = RLDataset(files, tiny_tokenizer, config())
    assert [example.index for example in dataset] == [0, 1, 2, 3, 4]


def test_config_chat_template_overrides_the_tokenizers(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS[:1])
    dataset = RLDataset(path, tiny_tokenizer, config(chat_template="Q: {{ messages[-1]['content'] }} A:"))
    assert tiny_tokenizer.decode(dataset[0].prompt_ids) == "Q: 1+1? A:"


def test_a_string_prompt_is_raw_text_unless_the_template_is_asked_for(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"data_source": "x", "prompt": "hello"},
                                                  {"data_source": "x", "prompt": [{"role": "user", "content": "hi"}]}])
    default = RLDataset(path, tiny_tokenizer, config())
    assert tiny_tokenizer.decode(default[0].prompt_ids) == "hello"  # as TRL feeds a string prompt
    assert tiny_tokenizer.decode(default[1].prompt_ids) == "<|user|>hi<eos><|assistant|>"
    templated = RLDataset(path, tiny_tokenizer, config(apply_chat_template=True))
    assert tiny_tokenizer.decode(templated[0].prompt_ids) == "<|user|>hello<eos><|assistant|>"
    assert templated[1].prompt_ids == default[1].prompt_ids
    raw = RLDataset(write_jsonl(tmp_path / "strings.jsonl", [{"data_source": "x", "prompt": "hello"}]), tiny_tokenizer,
                    config(apply_chat_template=False))
    assert tiny_tokenizer.decode(raw[0].prompt_ids) == "hello"
    assert raw[0].ground_truth is None and raw[0].extra_info == {}


def test_a_prompt_ending_with_an_assistant_message_is_continued(tmp_path, tiny_tokenizer):
    """TRL's prefill: the final assistant message stays open (continue_final_message), no new turn after it."""
    prompt = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "It is"}]
    dataset = RLDataset(write_jsonl(tmp_path / "train.jsonl", [{"data_source": "x", "prompt": prompt}]),
                        tiny_tokenizer, config())
    assert tiny_tokenizer.decode(dataset[0].prompt_ids) == "<|user|>hi<eos><|assistant|>It is"


def test_prompt_key_names_the_column(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"question": [{"role": "user", "content": "hi"}], "data_source": "x"}])
    assert tiny_tokenizer.decode(RLDataset(path, tiny_tokenizer, config(prompt_key="question"))[0].prompt_ids) \
        == "<|user|>hi<eos><|assistant|>"


def test_overlong_prompts_are_filtered_counted_and_logged(tmp_path, tiny_tokenizer, caplog):
    path = write_parquet(tmp_path / "train.parquet", ROWS)  # prompt lengths 7, 9, 15
    with caplog.at_level(logging.INFO, logger="reinforge.data.rl_dataset"):
        dataset = RLDataset(path, tiny_tokenizer, config(max_prompt_length=9))
    assert [example.ground_truth for example in dataset] == ["2", "42"]
    assert dataset.num_filtered == 1 and dataset.num_rows_read == 3
    assert "1 filtered" in caplog.text and "max_prompt_length=9" in caplog.text


def test_truncation_modes_when_not_filtering(tmp_path, tiny_tokenizer):
    path = write_parquet(tmp_path / "train.parquet", ROWS[2:])  # 15 tokens
    full = RLDataset(path, tiny_tokenizer, config())[0].prompt_ids
    left = RLDataset(path, tiny_tokenizer, config(max_prompt_length=5, filter_overlong_prompts=False,
                                                  truncation="left"))[0].prompt_ids
    right = RLDataset(path, tiny_tokenizer, config(max_prompt_length=5, filter_overlong_prompts=False,
                                                   truncation="right"))[0].prompt_ids
    assert left == full[-5:] and right == full[:5]
    with pytest.raises(ValueError, match=r"row 0 of .*train.parquet has a prompt of 15 tokens, more than "
                                         r"data.max_prompt_length=5"):
        RLDataset(path, tiny_tokenizer, config(max_prompt_length=5, filter_overlong_prompts=False))


def test_all_prompts_filtered_is_an_error(tmp_path, tiny_tokenizer):
    path = write_parquet(tmp_path / "train.parquet", ROWS)
    with pytest.raises(ValueError, match="no train prompt is left"):
        RLDataset(path, tiny_tokenizer, config(max_prompt_length=2))


def test_max_samples_keeps_the_first_prompts_that_fit(tmp_path, tiny_tokenizer):
    path = write_parquet(tmp_path / "train.parquet", [ROWS[2], *ROWS])
    dataset = RLDataset(path, tiny_tokenizer, config(max_prompt_length=9), max_samples=2)
    assert [example.index for example in dataset] == [1, 2]
    assert dataset.num_filtered == 1


def test_from_config_reads_train_and_val_files(tmp_path, tiny_tokenizer):
    train = write_parquet(tmp_path / "train.parquet", ROWS)
    val = write_jsonl(tmp_path / "val.jsonl", ROWS[:1])
    data_config = config(train_files=[train], val_files=[val], max_train_samples=2)
    assert len(RLDataset.from_config(data_config, tiny_tokenizer, "train")) == 2
    assert RLDataset.from_config(data_config, tiny_tokenizer, "val").name == "val"
    with pytest.raises(ValueError, match="set data.val_files"):
        RLDataset.from_config(config(), tiny_tokenizer, "val")


@pytest.mark.parametrize(("bad_row", "message"), [
    ({"data_source": "x"}, r"row 1 of .*train.jsonl has no 'prompt'; .*this row has: data_source"),
    ({"data_source": "x", "prompt": []}, r"row 1 of .*train.jsonl has an empty 'prompt'"),
    ({"data_source": "x", "prompt": {"role": "user"}}, r"row 1 of .*train.jsonl has a 'prompt' of type dict"),
    ({"data_source": "x", "prompt": [{"content": "hi"}]}, r"message 0 of the 'prompt' in row 1 of .*train.jsonl"),
    ({"data_source": "x", "prompt": [5, 17, 3]}, r"^the 'prompt' in row 1 of .*train.jsonl is a list of 3 token ids; "
                                                 r".* give the text column instead of the ids$"),
    ({"data_source": "x", "prompt": json.dumps([{"role": "user", "content": "hi"}])},
     r"^row 1 of .*train.jsonl has a 'prompt' that is chat messages written as JSON text, which the model would read"),
])
def test_malformed_row_names_file_row_and_fix(tmp_path, tiny_tokenizer, bad_row, message):
    path = write_jsonl(tmp_path / "train.jsonl", [ROWS[0], bad_row])
    with pytest.raises(ValueError, match=message):
        RLDataset(path, tiny_tokenizer, config())


def test_wrong_prompt_type_in_parquet(tmp_path, tiny_tokenizer):
    path = write_parquet(tmp_path / "train.parquet", [{"data_source": "x", "prompt": 41}, {"data_source": "x",
                                                                                          "prompt": 42}])
    with pytest.raises(ValueError, match=r"row 0 of .*train.parquet has a 'prompt' of type int"):
        RLDataset(path, tiny_tokenizer, config())


def test_reward_model_must_be_a_dict(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "hi", "reward_model": "42"}])
    with pytest.raises(ValueError, match="row 0 of .*train.jsonl has a 'reward_model' of type str; expected a dict"):
        RLDataset(path, tiny_tokenizer, config())


def test_tokenizer_without_chat_template_says_what_to_set(tmp_path, make_tiny_tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS[:1])
    with pytest.raises(ValueError, match="row 0 of .*has no chat template; set data.chat_template"):
        RLDataset(path, make_tiny_tokenizer(chat_template=None), config())


def test_messages_without_chat_template_application_are_refused(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS[:1])
    with pytest.raises(ValueError, match="data.apply_chat_template is false"):
        RLDataset(path, tiny_tokenizer, config(apply_chat_template=False))


def test_reader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_rows(tmp_path / "missing.parquet")
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="expected a .parquet, .jsonl or .json file"):
        read_rows(tmp_path / "rows.csv")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="line 2 of .*broken.jsonl is not valid JSON"):
        read_rows(tmp_path / "broken.jsonl")
    (tmp_path / "list.json").write_text(json.dumps(ROWS))
    assert read_rows(tmp_path / "list.json") == ROWS
    # a folder of data files is not a save_to_disk folder: named with its files' glob (it was datasets' own words)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "part-0.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"data file '{tmp_path / 'shards'}' is a folder that datasets."
                                                   "Dataset.save_to_disk did not write; name its files instead, e.g. "
                                                   f"{tmp_path / 'shards' / '*.jsonl'} (check data.train_files")):
        read_rows(tmp_path / "shards")


def test_datasets_folder_with_splits_asks_for_one(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "all"))
    with pytest.raises(ValueError, match="holds several splits .*train"):
        read_rows(tmp_path / "all")


def test_extra_columns_are_kept_for_the_scorer_and_rows_are_located(tmp_path, tiny_tokenizer):
    rows = [{**row, "answer": str(index), "difficulty": index} for index, row in enumerate(ROWS)]
    first = write_parquet(tmp_path / "a.parquet", rows[:1])
    second = write_jsonl(tmp_path / "b.jsonl", rows[1:])
    dataset = RLDataset([first, second], tiny_tokenizer, config())
    assert [example.columns for example in dataset.examples] == [{"answer": "0", "difficulty": 0},
                                                                 {"answer": "1", "difficulty": 1},
                                                                 {"answer": "2", "difficulty": 2}]
    assert dataset.where(dataset[0]) == f"row 0 of {first}"
    assert dataset.where(dataset[2]) == f"row 1 of {second}"
    from reinforge.data.prompt_loader import collate_prompts

    batch = collate_prompts(dataset.examples[:2], 0, ["a", "b"])
    assert list(batch["columns"]) == [{"answer": "0", "difficulty": 0}, {"answer": "1", "difficulty": 1}]


def test_message_with_null_content_names_the_row(tmp_path, tiny_tokenizer):
    rows = [ROWS[0], {**ROWS[1], "prompt": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]}]
    path = write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(ValueError) as error:
        RLDataset(path, tiny_tokenizer, config())
    assert str(error.value) == (f"message 0 (system) of the 'prompt' in row 1 of {path} has content null and no "
                                "tool_calls; give it a string ('' for an empty message) or drop the message")


def test_non_utf8_byte_names_the_file_and_line(tmp_path):
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_bytes(json.dumps(ROWS[0]).encode() + b"\n" + b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"^line 2 of {jsonl} has a byte that is not UTF-8 \(0xe9 at byte 16 of the "
                                         r"line\); save the file as UTF-8$"):
        read_rows(jsonl)
    listed = tmp_path / "train.json"
    listed.write_bytes(b'[\n{"prompt": "ok"},\n{"prompt": "caf\xe9"}\n]\n')
    with pytest.raises(ValueError, match=rf"^line 3 of {listed} has a byte that is not UTF-8 \(0xe9"):
        read_rows(listed)
    listed.write_bytes(b'\xef\xbb\xbf[\n{"prompt": "ok"},\n\xe9{"prompt": "ok"}\n]\n')  # after a byte-order mark
    with pytest.raises(ValueError, match=rf"^line 3 of {listed} has a byte that is not UTF-8 \(0xe9 at byte 1 of"):
        read_rows(listed)


def test_parquet_with_a_repeated_column_or_no_parquet_at_all_is_one_line(tmp_path):
    repeated = tmp_path / "repeated.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"]), pa.array(["x"])],
                                        names=["prompt", "prompt", "data_source"]), repeated)
    with pytest.raises(ValueError, match=rf"^{repeated} has more than one column named 'prompt'; "):
        read_rows(repeated)
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"^{empty} is not a readable parquet file \(") as error:
        read_rows(empty)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("message", "problem"), [
    ({"role": "usr", "content": "1+1?"}, "has role 'usr', which is not one of system, developer, user, assistant, "
                                         r"tool, function, ipython; rename it \("),
    ({"role": "Assistant", "content": "2"}, "has role 'Assistant', which is not one of "),
    ({"role": "gpt", "content": "2"}, "has role 'gpt', which is not one of "),  # ShareGPT's
    ({"role": "user", "content": [{"type": "text", "text": "1+1?"}]},
     r"has a 'content' of type list; reinforge trains text-only models: give it as a string \(join the "
     r"text of a list of parts\)"),
    ({"role": "user", "content": 5}, r"has a 'content' of type int; "),
    ({"role": "assistant", "content": None}, "has content null and no tool_calls; "),
])
def test_a_message_a_template_would_render_oddly_is_refused_naming_message_row_and_file(tmp_path, tiny_tokenizer,
                                                                                        message, problem):
    """The tiny template renders each of these without an error (an odd header, a Python repr, "None"): the check,
    shared with SFT, refuses them while the data is read, before any model loads."""
    rows = [ROWS[0], {**ROWS[1], "prompt": [{"role": "system", "content": "be brief"}, message]}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(ValueError, match=rf"^message 1 (\(\w+\) )?of the 'prompt' in row 1 of {path} {problem}") as error:
        RLDataset(path, tiny_tokenizer, config())
    assert "\n" not in str(error.value)


def test_legitimate_messages_stay_accepted(tmp_path, tiny_tokenizer):
    """Every known role, an empty string, and an assistant turn whose content is its tool calls (null or '')."""
    call = [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]
    prompt = [{"role": "system", "content": ""}, {"role": "developer", "content": "add"},
              {"role": "user", "content": "1+1?"}, {"role": "assistant", "content": None, "tool_calls": call},
              {"role": "tool", "content": "2"}, {"role": "assistant", "content": "", "tool_calls": call},
              {"role": "function", "content": "2"}, {"role": "ipython", "content": "2"},
              {"role": "assistant", "content": "2"}, {"role": "user", "content": "and 2+2?"}]
    path = write_jsonl(tmp_path / "train.jsonl", [{**ROWS[0], "prompt": prompt}])
    assert RLDataset(path, tiny_tokenizer, config(max_prompt_length=512))[0].raw_prompt == prompt


def test_a_template_that_fails_on_a_prompt_names_the_row(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS[:1])
    template = "{% for m in messages %}{{ '<|user|>' + m['content'] + m['name'] }}{% endfor %}"  # no 'name' key
    with pytest.raises(ValueError, match=rf"^row 0 of {path}: the chat template cannot render this prompt \(.*\); "
                                         r"give each message's 'content' as a string$"):
        RLDataset(path, tiny_tokenizer, config(chat_template=template))


def test_a_jsonl_file_with_a_byte_order_mark_reads_and_an_empty_string_prompt_is_refused(tmp_path, tiny_tokenizer):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(row) + "\n" for row in ROWS).encode())
    assert read_rows(bom) == ROWS
    listed = tmp_path / "bom.json"  # a JSON list, as Windows' editors save it
    listed.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS).encode())
    assert read_rows(listed) == ROWS
    lines = tmp_path / "lines.json"  # one object per line, as datasets' to_json writes a .json file
    lines.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    assert read_rows(lines) == ROWS
    lines.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1])[:-3] + "\n")
    with pytest.raises(ValueError, match=rf"^line 2 of {lines} is not valid JSON"):
        read_rows(lines)
    path = write_jsonl(tmp_path / "blank.jsonl", [ROWS[0], {**ROWS[1], "prompt": "  "}])
    with pytest.raises(ValueError, match=rf"^row 1 of {path} has an empty 'prompt' string; "):
        RLDataset(path, tiny_tokenizer, config())


def test_a_glob_in_the_data_files_reads_every_match_in_order_and_an_empty_one_is_named(tmp_path, tiny_tokenizer):
    (tmp_path / "shards").mkdir()
    write_jsonl(tmp_path / "shards" / "b.jsonl", ROWS[1:])
    write_parquet(tmp_path / "shards" / "a.parquet", ROWS[:1])
    dataset = RLDataset([str(tmp_path / "shards" / "*")], tiny_tokenizer, config())
    assert [example.ground_truth for example in dataset.examples] == ["2", "42", "600"]
    with pytest.raises(FileNotFoundError, match=r"data.train_files pattern '.*\*.parquet' matches no file"):
        RLDataset([str(tmp_path / "none" / "*.parquet")], tiny_tokenizer, config())
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match=rf"the train files \({empty}\) hold no rows"):
        RLDataset([empty], tiny_tokenizer, config())


def test_a_row_giving_one_key_twice_is_refused_with_its_line(tmp_path):
    """json keeps the last of two equal keys: a row with two "prompt" keys trained on the second without a word."""
    lines = tmp_path / "rows.jsonl"
    lines.write_text(json.dumps(ROWS[0]) + "\n" + '{"prompt": "a", "prompt": "b", "data_source": "x"}\n')
    with pytest.raises(ValueError, match=r"^line 2 of .*rows.jsonl gives the key 'prompt' twice in one object; keep "
                                         r"one of them$"):
        read_rows(lines)
    listed = tmp_path / "rows.json"
    listed.write_text('[{"data_source": "x", "extra_info": {"a": 1, "a": 2}}]')
    with pytest.raises(ValueError, match=r"rows.json gives the key 'a' twice in one object"):
        read_rows(listed)


def test_the_shipped_converters_and_tasks_write_chat_messages_so_their_prompts_keep_the_template(tmp_path,
                                                                                                 tiny_tokenizer):
    """A string prompt is fed raw by default: the rows reinforge writes itself (GSM8K, ReTool, the arithmetic task
    the demo trains on) must be chat messages to get the template the demo and examples were built with."""
    from reinforge.data.gsm8k import make_gsm8k_row
    from reinforge.data.retool import make_retool_row
    from reinforge.data.tasks.arithmetic import generate_problems, make_rl_rows

    rows = [make_gsm8k_row("How many?", "2 + 2 = 4\n#### 4", "train", 0),
            make_retool_row("How many?", "2 + 2 = 4\n#### 4", "train", 1),
            *make_rl_rows(generate_problems(2, "train", max_digits=1), "train")]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    for example, row in zip(RLDataset(path, tiny_tokenizer, config(max_prompt_length=512)), rows, strict=True):
        assert isinstance(row["prompt"], list)
        assert tiny_tokenizer.decode(example.prompt_ids).startswith("<|user|>")
