import pickle

import numpy as np
import pytest
import torch

from reinforge.protocol import Batch


def make_batch(rows: int = 5) -> Batch:
    return Batch.from_dict(
        tensors={"input_ids": torch.arange(rows * 3).reshape(rows, 3), "score": torch.arange(rows).float()},
        non_tensors={"uid": [f"u{i}" for i in range(rows)], "extra": [{"i": i} for i in range(rows)]},
        meta={"reward_metrics": {"acc": 0.7}},
    )


def test_length_and_columns():
    batch = make_batch()
    assert len(batch) == 5
    assert batch["uid"][2] == "u2"
    assert batch["extra"][1] == {"i": 1}
    assert set(batch.keys()) == {"input_ids", "score", "uid", "extra"}


def test_misaligned_columns_are_rejected():
    with pytest.raises(ValueError, match="disagree"):
        Batch.from_dict(tensors={"a": torch.zeros(3)}, non_tensors={"b": [1, 2]})


def test_split_pads_and_concat_unpadded_restores_order():
    batch = make_batch(5)
    chunks = batch.split(2)
    assert [len(chunk) for chunk in chunks] == [3, 3]
    restored = Batch.concat_unpadded(chunks)
    assert torch.equal(restored["input_ids"], batch["input_ids"])
    assert list(restored["uid"]) == list(batch["uid"])
    assert "num_padding" not in restored.meta
    assert restored.meta["reward_metrics"] == {"acc": 0.7}


def test_split_even_has_no_padding():
    chunks = make_batch(4).split(4)
    assert all(len(chunk) == 1 for chunk in chunks)
    assert chunks[0].meta["num_padding"] == 0


def test_repeat_interleaved_and_tiled():
    batch = make_batch(2)
    interleaved = batch.repeat(3, interleave=True)
    assert list(interleaved["uid"]) == ["u0", "u0", "u0", "u1", "u1", "u1"]
    assert torch.equal(interleaved["score"], torch.tensor([0.0, 0, 0, 1, 1, 1]))
    tiled = batch.repeat(2, interleave=False)
    assert list(tiled["uid"]) == ["u0", "u1", "u0", "u1"]
    assert tiled["input_ids"].shape == (4, 3)


def test_select_union_and_conflicts():
    batch = make_batch(3)
    left = batch.select(["input_ids", "uid"])
    right = Batch.from_dict(tensors={"values": torch.ones(3, 2)}, meta={"a": 1})
    merged = left | right
    assert set(merged.keys()) == {"input_ids", "uid", "values"}
    assert merged.meta == {"reward_metrics": {"acc": 0.7}, "a": 1}
    clash = Batch.from_dict(tensors={"input_ids": torch.zeros(3, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match="input_ids"):
        left | clash
    with pytest.raises(KeyError, match="nope"):
        batch.select(["nope"])


def test_boolean_mask_and_index_list():
    batch = make_batch(4)
    picked = batch[torch.tensor([True, False, True, False])]
    assert list(picked["uid"]) == ["u0", "u2"]
    assert torch.equal(picked["score"], torch.tensor([0.0, 2.0]))
    reordered = batch.index([3, 0])
    assert list(reordered["uid"]) == ["u3", "u0"]
    with pytest.raises(ValueError, match="mask"):
        batch[torch.tensor([True, False])]


def test_concat_rejects_different_columns():
    with pytest.raises(ValueError, match="columns"):
        Batch.concat([make_batch(2), make_batch(2).select(["uid"])])
    with pytest.raises(ValueError, match="'input_ids' is missing from batches \\[0\\]"):
        Batch.concat([make_batch(2).select(["uid"]), make_batch(2)])


def test_concat_fills_an_optional_column_a_batch_lacks_and_pads_left_padded_tensors():
    """Batches whose rows differ (a member's share): a column only some have, named in meta EMPTY_VALUES (the images
    column always), gets its empty value on the others' rows in either order; a LEFT_PADDED tensor is padded on the
    left to the widest; a tensor of other widths not so named, or a clash of empty values, is refused by name."""
    from reinforge.protocol import EMPTY_VALUES, LEFT_PADDED, MULTI_MODAL_KEY

    image = {"pixel_values": torch.ones(4, 2), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    plain = Batch.from_dict(tensors={"prompts": torch.ones(2, 2, dtype=torch.long)}, non_tensors={"uid": ["a", "b"]},
                            meta={LEFT_PADDED: {"prompts": 0}})
    rich = Batch.from_dict(tensors={"prompts": torch.full((2, 3), 5)},
                           non_tensors={"uid": ["c", "d"], MULTI_MODAL_KEY: [image, {}], "reward_acc": [True, False]},
                           meta={EMPTY_VALUES: {"reward_acc": None}})
    merged, reverse = Batch.concat([plain, rich]), Batch.concat([rich, plain])
    assert list(merged[MULTI_MODAL_KEY]) == [{}, {}, image, {}] and list(merged["reward_acc"]) == [None, None, True, False]
    assert list(reverse["reward_acc"]) == [True, False, None, None] and list(reverse["uid"]) == ["c", "d", "a", "b"]
    assert merged["prompts"].tolist() == [[0, 1, 1], [0, 1, 1], [5, 5, 5], [5, 5, 5]]
    assert merged.meta[EMPTY_VALUES] == {"reward_acc": None} and merged.meta[LEFT_PADDED] == {"prompts": 0}
    with pytest.raises(ValueError, match="'prompts'.*not named in meta 'left_padded'"):
        Batch.concat([Batch.from_dict(tensors={"prompts": torch.ones(1, 2)}), Batch.from_dict(tensors={"prompts": torch.ones(1, 3)})])
    clash = Batch.from_dict(non_tensors={"uid": ["e"], "reward_acc": [1]}, meta={EMPTY_VALUES: {"reward_acc": 0}})
    with pytest.raises(ValueError, match="'reward_acc'"):
        Batch.concat([rich.select(["uid", "reward_acc"]), clash])


def test_setitem_pop_and_to():
    batch = make_batch(3)
    batch["advantages"] = torch.zeros(3, 4)
    batch["names"] = ["a", "b", "c"]
    assert isinstance(batch["names"], np.ndarray)
    with pytest.raises(ValueError, match="rows"):
        batch["bad"] = torch.zeros(2)
    popped = batch.pop(["advantages"])
    assert "advantages" not in batch and "advantages" in popped
    moved = batch.to("cpu")
    assert moved["input_ids"].device.type == "cpu"


def test_pickle_round_trip_keeps_everything():
    batch = make_batch(4)
    restored = pickle.loads(pickle.dumps(batch))
    assert torch.equal(restored["input_ids"], batch["input_ids"])
    assert list(restored["extra"]) == list(batch["extra"])
    assert restored.meta == batch.meta
