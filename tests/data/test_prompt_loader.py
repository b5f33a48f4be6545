import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reinforge.config.schema import DataConfig
from reinforge.data.chat_template import get_pad_token_id
from reinforge.data.prompt_loader import PromptLoader, collate_prompts
from reinforge.data.rl_dataset import PromptExample


class ListDataset:
    """Just what PromptLoader reads from an RLDataset: name, len and examples by position."""

    def __init__(self, num_prompts: int, name: str = "train") -> None:
        self.name = name
        self.examples = [PromptExample(index=100 + i, prompt_ids=[7] * (1 + i % 3), raw_prompt=f"p{i}",
                                       data_source="arithmetic", ground_truth=str(i), extra_info={"i": i})
                         for i in range(num_prompts)]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, position: int) -> PromptExample:
        return self.examples[position]


def test_collate_left_pads_and_keeps_reward_inputs():
    examples = [PromptExample(index=3, prompt_ids=[5, 6, 7], raw_prompt=[{"role": "user", "content": "a"}],
                              data_source="openai/gsm8k", ground_truth="72", extra_info={"split": "train"}),
                PromptExample(index=9, prompt_ids=[8], raw_prompt="b", data_source="countdown",
                              ground_truth={"target": 3, "numbers": [1, 2]}, extra_info={})]
    batch = collate_prompts(examples, pad_token_id=0, uids=["u0", "u1"])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == torch.int64
    assert list(batch["data_source"]) == ["openai/gsm8k", "countdown"]
    assert list(batch["ground_truth"]) == ["72", {"target": 3, "numbers": [1, 2]}]
    assert list(batch["extra_info"]) == [{"split": "train"}, {}]
    assert batch["raw_prompt"][0] == [{"role": "user", "content": "a"}] and batch["raw_prompt"][1] == "b"
    assert list(batch["index"]) == [3, 9] and list(batch["uid"]) == ["u0", "u1"]


@pytest.mark.parametrize("names, marked", [(["tool_agent", None], True), (["single_turn", None], False),
                                            ([None, None], False)])
def test_a_batch_with_a_multi_turn_row_is_marked_for_the_agent_path(names, marked):
    from reinforge.data.prompt_loader import AGENT_LOOPS

    examples = [PromptExample(index=i, prompt_ids=[5], raw_prompt="a", data_source="arithmetic", ground_truth="1",
                              extra_info={}, agent_name=name) for i, name in enumerate(names)]
    assert collate_prompts(examples, pad_token_id=0, uids=["u0", "u1"]).meta.get(AGENT_LOOPS, False) is marked


def test_pad_id_falls_back_to_eos(make_tiny_tokenizer):
    assert get_pad_token_id(make_tiny_tokenizer()) == 0
    assert get_pad_token_id(make_tiny_tokenizer(pad_token=None)) == 1


def indices(batch):
    return [int(index) for index in batch["index"]]


def take(loader, num_batches):
    iterator = iter(loader)
    return [next(iterator) for _ in range(num_batches)]


def test_training_epochs_are_seeded_permutations_without_the_last_partial_batch():
    loader = PromptLoader(ListDataset(10), batch_size=3, pad_token_id=0, seed=5)
    assert len(loader) == 3
    batches = take(loader, 6)  # two epochs
    first_epoch = [index for batch in batches[:3] for index in indices(batch)]
    second_epoch = [index for batch in batches[3:] for index in indices(batch)]
    assert len(set(first_epoch)) == 9 and len(set(second_epoch)) == 9
    assert first_epoch != second_epoch
    assert loader.epoch == 1 and loader.position == 3
    again = take(PromptLoader(ListDataset(10), batch_size=3, pad_token_id=0, seed=5), 6)
    assert [indices(batch) for batch in again] == [indices(batch) for batch in batches]
    other_seed = take(PromptLoader(ListDataset(10), batch_size=3, pad_token_id=0, seed=6), 3)
    assert [indices(batch) for batch in other_seed] != [indices(batch) for batch in batches[:3]]


def test_uids_are_unique_within_a_step_and_across_epochs():
    loader = PromptLoader(ListDataset(4), batch_size=4, pad_token_id=0)
    first, second = take(loader, 2)
    assert len(set(first["uid"])) == 4
    assert not set(first["uid"]) & set(second["uid"])


def test_no_shuffle_keeps_file_order():
    loader = PromptLoader(ListDataset(4), batch_size=2, pad_token_id=0, shuffle=False)
    assert [indices(batch) for batch in take(loader, 3)] == [[100, 101], [102, 103], [100, 101]]


@settings(max_examples=40, deadline=None)
@given(num_prompts=st.integers(1, 12), batch_size=st.integers(1, 5), consumed=st.integers(0, 12),
       seed=st.integers(0, 3))
def test_resumed_loader_yields_exactly_the_next_batches(num_prompts, batch_size, consumed, seed):
    batch_size = min(batch_size, num_prompts)
    original = PromptLoader(ListDataset(num_prompts), batch_size, pad_token_id=0, seed=seed)
    iterator = iter(original)
    for _ in range(consumed):
        next(iterator)
    state = original.state_dict()
    expected = [next(iterator) for _ in range(5)]

    resumed = PromptLoader(ListDataset(num_prompts), batch_size, pad_token_id=0, seed=seed)
    resumed.load_state_dict(state)
    actual = take(resumed, 5)
    for want, got in zip(expected, actual, strict=True):
        assert indices(got) == indices(want)
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert list(got["uid"]) == list(want["uid"])


def test_resume_refuses_a_different_dataset_or_batch_size():
    state = PromptLoader(ListDataset(10), 2, pad_token_id=0).state_dict()
    with pytest.raises(ValueError, match="num_prompts=10 but this run has 9"):
        PromptLoader(ListDataset(9), 2, pad_token_id=0).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size=2 but this run has 3"):
        PromptLoader(ListDataset(10), 3, pad_token_id=0).load_state_dict(state)


def test_resume_over_the_same_number_of_changed_prompts_warns_once_and_goes_on(caplog):
    original = PromptLoader(ListDataset(10), 2, pad_token_id=0)
    next(iter(original))
    state = original.state_dict()
    resumed = PromptLoader(ListDataset(10), 2, pad_token_id=0)
    resumed.load_state_dict(state)
    assert "data files changed" not in caplog.text  # the same rows: nothing to say
    changed = ListDataset(10)
    changed.examples[4] = PromptExample(index=104, prompt_ids=[8], raw_prompt="other", data_source="arithmetic",
                                        ground_truth="4", extra_info={})
    answer_changed = ListDataset(10)
    answer_changed.examples[4] = PromptExample(index=104, prompt_ids=[7, 7], raw_prompt="p4",
                                               data_source="arithmetic", ground_truth="5", extra_info={})
    for dataset in (changed, answer_changed):
        caplog.clear()
        loader = PromptLoader(dataset, 2, pad_token_id=0)
        loader.load_state_dict(state)
        loader.load_state_dict(state)  # checked before the model loads, then loaded: said once
        assert caplog.text.count("the data files changed since the checkpoint was written (the same 10 prompts") == 1
        assert (loader.epoch, loader.position) == (0, 1)


def test_validation_goes_over_every_prompt_once_in_order():
    dataset = ListDataset(5, name="val")
    loader = PromptLoader.for_validation(dataset, DataConfig(val_batch_size=2), pad_token_id=0)
    assert len(loader) == 3
    first_pass = [indices(batch) for batch in loader]
    assert first_pass == [[100, 101], [102, 103], [104]]
    assert [indices(batch) for batch in loader] == first_pass
    whole = PromptLoader.for_validation(dataset, DataConfig(), pad_token_id=0)
    assert [indices(batch) for batch in whole] == [[100, 101, 102, 103, 104]]


def test_for_training_reads_the_config():
    loader = PromptLoader.for_training(ListDataset(6), DataConfig(train_batch_size=4, seed=3, shuffle=False),
                                       pad_token_id=0)
    assert (loader.batch_size, loader.seed, loader.shuffle, len(loader)) == (4, 3, False, 1)


def test_batch_larger_than_the_dataset_is_an_error():
    with pytest.raises(ValueError, match="data.train_batch_size=8 is larger than the 5 train prompts"):
        PromptLoader(ListDataset(5), 8, pad_token_id=0)


def test_missing_pad_id_points_to_the_fallback():
    with pytest.raises(ValueError, match="get_pad_token_id"):
        PromptLoader(ListDataset(4), 2, pad_token_id=None)


def test_a_generation_batch_larger_than_the_data_names_data_gen_batch_size():
    """Dynamic sampling's loader hands out data.gen_batch_size prompts; the refusal named data.train_batch_size."""
    config = DataConfig(train_batch_size=1, gen_batch_size=3)
    with pytest.raises(ValueError, match=r"^data.gen_batch_size=3 is larger than the 2 train prompts"):
        PromptLoader.for_training(ListDataset(2), config, pad_token_id=0)
    with pytest.raises(ValueError, match=r"^data.train_batch_size=3 is larger than the 2 train prompts"):
        PromptLoader.for_training(ListDataset(2), DataConfig(train_batch_size=3), pad_token_id=0)
