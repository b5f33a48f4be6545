"""The SFT loader processes each row's images once and collates what processing them again would give."""

import io

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

from reinforge.data.sft_dataset import SFTDataset, SFTLoader
from reinforge.models.tiny_vlm import build_tiny_processor
from reinforge.protocol import MULTI_MODAL_KEY


def png(color, size) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def loader_and_calls(tmp_path, max_bytes: int | None = None) -> tuple[SFTLoader, list[int]]:
    processor = build_tiny_processor("qwen2_5_vl")
    rows = [{"messages": [{"role": "user", "content": "<image>How many?"}, {"role": "assistant", "content": str(n)}],
             "images": [png((40 * n, 0, 0), (16 + 8 * n, 32))]} for n in range(3)]
    rows.append({"messages": [{"role": "user", "content": "No picture."}, {"role": "assistant", "content": "ok"}]})
    path = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    dataset = SFTDataset([path], processor.tokenizer, max_length=128, processor=processor)
    calls = []
    image_processor = processor.image_processor
    process = image_processor.__call__

    class Counting(type(image_processor)):
        def __call__(self, *args, **kwargs):
            calls.append(1)
            return process(*args, **kwargs)

    image_processor.__class__ = Counting
    loader = SFTLoader(dataset.examples, 3, processor.tokenizer.pad_token_id, processor=processor, seed=4)
    if max_bytes is not None:
        loader.images.max_bytes = max_bytes
    return loader, calls


def assert_same_images(batch, expected) -> None:
    assert (MULTI_MODAL_KEY in batch.non_tensors) == (MULTI_MODAL_KEY in expected.non_tensors)
    if MULTI_MODAL_KEY not in expected.non_tensors:
        return
    assert len(batch[MULTI_MODAL_KEY]) == len(expected[MULTI_MODAL_KEY])
    for got, want in zip(batch[MULTI_MODAL_KEY], expected[MULTI_MODAL_KEY], strict=True):
        assert got.keys() == want.keys()
        for key in got:
            assert torch.equal(got[key], want[key])


def test_each_rows_images_are_processed_once_and_batches_are_unchanged(tmp_path):
    loader, calls = loader_and_calls(tmp_path)
    uncached, uncached_calls = loader_and_calls(tmp_path, max_bytes=0)
    for _ in range(6):  # 4 rows in batches of 3: three epochs, the same order in both
        batch, expected = loader.next_batch(), uncached.next_batch()
        assert torch.equal(batch["input_ids"], expected["input_ids"])
        assert_same_images(batch, expected)
    assert len(calls) == 3 and len(uncached_calls) > 6
    loader.batches_of_one_pass()
    assert len(calls) == 3 and len(loader.images.entries) == 4 and loader.images.bytes > 0


def test_rows_past_the_byte_budget_are_processed_at_every_use(tmp_path):
    loader, calls = loader_and_calls(tmp_path, max_bytes=0)
    first = loader.batches_of_one_pass()
    assert len(calls) == 3
    again = loader.batches_of_one_pass()
    assert len(calls) == 6 and not any(loader.images.entries.values())
    for batch, expected in zip(again, first, strict=True):
        assert_same_images(batch, expected)


def test_a_rows_image_tokens_are_counted_from_its_size_as_the_processor_makes_them():
    """Loading processed every image's pixels only to count its tokens (and the loader processed them again); the
    count from the image's size is the processor's own, pixel bounds and odd sides included."""
    from types import SimpleNamespace

    from reinforge.data.multimodal import image_inputs, image_marker, images_tokens, text_and_images_ids

    images = [Image.new("RGB", size) for size in [(1, 1), (7, 300), (300, 7), (33, 65), (16, 16), (640, 480),
                                                  (2000, 30)]]
    for arch in ("qwen2_5_vl", "qwen3_vl"):
        processor = build_tiny_processor(arch)
        merge = processor.image_processor.merge_size
        expected = (image_inputs(processor, images)["image_grid_thw"].prod(-1) // merge**2).tolist()
        assert images_tokens(processor, images) == expected, arch

        def processes(processor=processor, **kwargs):  # an image processor that cannot count from a size
            return processor.image_processor(**kwargs)

        processes.merge_size = merge
        assert images_tokens(SimpleNamespace(image_processor=processes), images) == expected, arch
        # a prompt's ids (RL data) as the processor makes them from the pixels
        text = f"a {image_marker(processor)} b {image_marker(processor)}{image_marker(processor)} c"
        for shown in (images[1:4], images[4:]):
            made = processor(text=[text], images=shown, return_tensors="pt", add_special_tokens=False)
            assert text_and_images_ids(processor, text, shown) == made["input_ids"][0].tolist(), arch
