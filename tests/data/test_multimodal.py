import base64
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from reinforge.config.schema import DataConfig
from reinforge.data import PromptLoader
from reinforge.data.multimodal import count_image_placeholders, with_image_parts
from reinforge.data.rl_dataset import RLDataset
from reinforge.models.tiny_vlm import build_tiny_processor
from reinforge.protocol import MULTI_MODAL_KEY


@pytest.fixture(scope="module")
def processor():
    return build_tiny_processor("qwen2_5_vl")


def png(color, size=(32, 32)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def verl_row(images, text="<image>How many red squares?", answer="1"):
    return {"data_source": "squares", "prompt": [{"role": "user", "content": text}],
            "images": images, "reward_model": {"ground_truth": answer}}


def trl_row(image, text="How many red squares?"):
    return {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
            "image": image, "answer": "2"}


def config(**overrides):
    return DataConfig(**{"max_prompt_length": 256, **overrides})


def test_verl_rows_in_parquet_get_the_processors_ids_and_pixels(tmp_path, processor):
    path = tmp_path / "train.parquet"
    file_image = tmp_path / "blue.png"
    file_image.write_bytes(png((0, 0, 255), (48, 24)))
    rows = [verl_row([{"bytes": png((255, 0, 0)), "path": None}]),
            verl_row([{"bytes": None, "path": str(file_image)}, {"bytes": png((0, 255, 0)), "path": None}],
                     text="<image> and <image>: how many?"),
            verl_row([], text="no image here")]
    pq.write_table(pa.Table.from_pylist(rows), path)
    dataset = RLDataset(path, processor.tokenizer, config(), processor=processor)
    first = dataset[0]
    images = [Image.open(io.BytesIO(png((255, 0, 0)))).convert("RGB")]
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many red squares?"}]}],
        add_generation_prompt=True, tokenize=False)
    expected = processor(text=[text], images=images, return_tensors="pt")
    assert first.prompt_ids == expected["input_ids"][0].tolist()
    assert first.prompt_ids.count(processor.image_token_id) == 4  # 32 x 32 pixels: 4 x 4 patches, merged 2 x 2
    assert dataset[1].prompt_ids.count(processor.image_token_id) == 6 + 4  # 48 x 24 resized to 48 x 32
    assert dataset[2].images == () and processor.image_token_id not in dataset[2].prompt_ids

    batch = next(iter(PromptLoader(dataset, 3, processor.tokenizer.pad_token_id, shuffle=False)))
    inputs = list(batch[MULTI_MODAL_KEY])
    torch.testing.assert_close(inputs[0]["pixel_values"], expected["pixel_values"], rtol=0, atol=0)
    assert inputs[0]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert inputs[1]["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 4]] and inputs[2] == {}
    repeated = batch.repeat(2, interleave=True)
    assert repeated[MULTI_MODAL_KEY][1] is inputs[0]


def test_trl_conversations_with_image_parts_and_extra_columns(tmp_path, processor):
    path = tmp_path / "train.jsonl"
    image_file = tmp_path / "red.png"
    image_file.write_bytes(png((255, 0, 0)))
    path.write_text(json.dumps(trl_row(str(image_file))) + "\n")
    dataset = RLDataset(path, processor.tokenizer, config(), processor=processor)
    assert dataset[0].prompt_ids.count(processor.image_token_id) == 4
    assert dataset[0].columns["answer"] == "2"  # a scorer's extra column, as for text rows
    assert dataset[0].images == (str(image_file),)


def data_uri(data: bytes, header="data:image/png;base64,") -> str:
    return header + base64.b64encode(data).decode()


@pytest.mark.parametrize("form", [
    lambda file: {"bytes": png((255, 0, 0)), "path": "/no/such/file.png"},  # datasets' struct: its bytes first
    lambda file: {"image": str(file)},  # verl's and qwen_vl_utils'
    lambda file: {"image": png((255, 0, 0))},
    lambda file: {"type": "image", "image": f"file://{file}"},
    lambda file: {"image_url": {"url": data_uri(png((255, 0, 0)))}},
    lambda file: {"type": "image_url", "image_url": str(file)},
    lambda file: data_uri(png((255, 0, 0)), "data:image;base64,"),
], ids=["datasets-struct", "verl-path", "verl-bytes", "part-file-uri", "openai-data-uri", "image-url-path",
        "qwen-data-uri"])
def test_an_image_column_takes_verl_trl_and_openai_dicts(tmp_path, processor, form):
    file = tmp_path / "red.png"
    file.write_bytes(png((255, 0, 0)))
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([verl_row([form(file)])]), path)
    dataset = RLDataset(path, processor.tokenizer, config(), processor=processor)
    expected = processor.image_processor(images=[Image.new("RGB", (32, 32), (255, 0, 0))], return_tensors="pt")
    assert dataset[0].prompt_ids.count(processor.image_token_id) == 4
    torch.testing.assert_close(dataset.image_inputs(dataset[0])["pixel_values"], expected["pixel_values"])


def test_a_dict_holding_a_pil_image_is_read():
    from reinforge.data.multimodal import load_image

    image = load_image({"image": Image.new("RGBA", (8, 8), (0, 0, 255, 255))}, "row 0", 0)
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (0, 0, 255)


def part_images_prompt(file) -> list[dict]:
    """Qwen's and OpenAI's messages: each image inside its content part."""
    return [{"role": "user", "content": [{"type": "image", "image": str(file)}, {"type": "text", "text": "and"},
                                         {"type": "image_url", "image_url": {"url": data_uri(png((0, 255, 0)))}},
                                         {"type": "text", "text": "How many?"}]}]


def test_images_held_by_content_parts_are_the_rows_images(tmp_path, processor):
    """In parquet the text parts gain a null 'image' key (a struct has every part's keys), which a chat template
    asking ``'image' in part`` would render as an image."""
    from reinforge.data.sft_dataset import SFTDataset

    file = tmp_path / "red.png"
    file.write_bytes(png((255, 0, 0)))
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": part_images_prompt(file)}]), path)
    dataset = RLDataset(path, processor.tokenizer, config(), processor=processor)
    images = [Image.new("RGB", (32, 32), (255, 0, 0)), Image.new("RGB", (32, 32), (0, 255, 0))]
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                      {"type": "text", "text": "How many?"}]}], add_generation_prompt=True,
        tokenize=False)
    expected = processor(text=[text], images=images, return_tensors="pt")
    assert dataset[0].prompt_ids == expected["input_ids"][0].tolist()
    assert dataset[0].raw_prompt[0]["content"][0] == {"type": "image"}  # the bytes stay out of the logged prompt
    torch.testing.assert_close(dataset.image_inputs(dataset[0])["pixel_values"], expected["pixel_values"])

    messages = [*part_images_prompt(file), {"role": "assistant", "content": [{"type": "text", "text": "2"}]}]
    pq.write_table(pa.Table.from_pylist([{"messages": messages}]), path)
    example = SFTDataset([path], processor.tokenizer, max_length=128, processor=processor).examples[0]
    assert example.input_ids.count(processor.image_token_id) == 8 and len(example.images) == 2


@pytest.mark.parametrize("row, message", [
    (verl_row([{"caption": "a red square"}]),
     r"^row 0 of .*, column 'images': image 0 is a dict with 'caption' and no image; give each image as encoded "
     r"bytes, .*\{'image': ...\}"),
    (verl_row(["https://example.com/red.png"]),
     r"^row 0 of .*, column 'images': image 0 is the web address https://example.com/red.png, and reinforge "
     "downloads nothing"),
    ({"prompt": [{"role": "user", "content": [{"type": "image", "image": "red.png"}]}], "images": [png((1, 2, 3))]},
     r"^row 0 of .* has 1 image\(s\) in the content parts of its 'prompt' and 1 in its 'images' column; give each "
     "image once"),
])
def test_an_image_dict_without_an_image_is_one_line(tmp_path, processor, row, message):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    with pytest.raises(ValueError, match=message):
        RLDataset(path, processor.tokenizer, config(), processor=processor)


def test_images_without_placeholders_open_the_first_user_message():
    messages = [{"role": "system", "content": "count"}, {"role": "user", "content": "how many?"}]
    assert with_image_parts(messages, 2)[1]["content"] == [{"type": "image"}, {"type": "image"},
                                                            {"type": "text", "text": "how many?"}]
    assert count_image_placeholders([{"role": "user", "content": [{"type": "text", "text": "<image> x"}]}]) == 1


@pytest.mark.parametrize("row, message", [
    (verl_row([{"bytes": None, "path": "/no/such/image.png"}]), "row 0 of .*image 0 is the file /no/such/image.png, "
                                                                "which does not exist"),
    (verl_row([b"not an image"]), r"row 0 of .*image 0 \(12 bytes\) cannot be read as an image"),
    (verl_row([png((1, 2, 3)), "/data/red.png"], text="<image><image>"),  # pyarrow stores the path as its bytes
     r"row 0 of .*image 1 \(13 bytes\) cannot be read as an image .*; its bytes are the text '/data/red.png', a "
     "file path: a parquet column that holds bytes stores a path as its bytes"),
    (verl_row([png((1, 2, 3)), png((4, 5, 6))]), r"row 0 of .* has 2 image\(s\) but 1 image placeholder\(s\)"),
    (verl_row([{"bytes": png((1, 2, 3)), "path": None, "max_pixels": 64 * 64}]),
     r"row 0 of .*image 0 sets max_pixels, which reinforge does not apply per image"),
    ({**verl_row([png((1, 2, 3))]), "prompt": "a string prompt without placeholder"},
     r"has 1 image\(s\) but 0 image placeholder"),
    (verl_row([png((1, 2, 3)), None], text="<image> and <image>"),
     r"^row 0 of .*, column 'images': image 1 of 2 is null, and each entry is the image of one placeholder"),
    ({**trl_row(None), "image": None, "images": [None, png((1, 2, 3))]},
     r"^row 0 of .*, column 'images': image 0 of 2 is null"),
    (verl_row([png((1, 2, 3), size=(402, 2))]),
     r"^row 0 of .*image 0 is 402 x 2 pixels, a strip whose long side is more than 200 times its short side, which "
     "the image processor cannot resize; pad or crop it"),
    (verl_row([png((1, 2, 3))], text="<image>what is <|image_pad|>?"),
     r"^row 0 of .*: its rendered text holds 2 '<\|image_pad\|>' tokens for its 1 image\(s\): its own text spells 1"),
    ({"prompt": [{"role": "system", "content": "count"}], "images": [png((1, 2, 3))]},
     r"^row 0 of .*: its rendered text holds 0 '<\|image_pad\|>' tokens for its 1 image\(s\): the chat template "
     "rendered no place for 1 of them"),
])
def test_broken_rows_fail_at_load_naming_the_row(tmp_path, processor, row, message):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    with pytest.raises(ValueError, match=message):
        RLDataset(path, processor.tokenizer, config(), processor=processor)


def encoded(image, format="PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    return buffer.getvalue()


def rotated_jpeg() -> bytes:
    """A 48 x 16 picture whose EXIF orientation (6) says: show it turned, 16 x 48."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encoded(Image.new("RGB", (48, 16), (255, 0, 0)), "JPEG", exif=exif)


@pytest.mark.parametrize("source, shown", [
    (encoded(Image.new("RGBA", (32, 32), (255, 0, 0, 0))), Image.new("RGB", (32, 32), (255, 255, 255))),
    (Image.new("LA", (32, 32), (0, 0)), Image.new("RGB", (32, 32), (255, 255, 255))),
    (encoded(Image.new("RGBA", (32, 32), (0, 0, 255, 128))), Image.new("RGB", (32, 32), (127, 127, 255))),
    (rotated_jpeg(), Image.open(io.BytesIO(rotated_jpeg())).transpose(Image.Transpose.ROTATE_270)),
])
def test_images_are_seen_as_transformers_shows_them(tmp_path, processor, source, shown):
    """Transparency over white (the processor's convert_to_rgb), and an encoded image turned upright by its EXIF
    orientation (datasets' Image feature and transformers' load_image)."""
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([verl_row([source if isinstance(source, bytes) else encoded(source)])]), path)
    dataset = RLDataset(path, processor.tokenizer, config(), processor=processor)
    expected = processor.image_processor(images=[shown], return_tensors="pt")
    inputs = dataset.image_inputs(dataset[0])
    assert torch.equal(inputs["image_grid_thw"], expected["image_grid_thw"])
    torch.testing.assert_close(inputs["pixel_values"], expected["pixel_values"], atol=0.05, rtol=0)


def test_an_image_too_large_to_open_safely_is_one_line(tmp_path, processor, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # a 32 x 32 picture is then over twice the limit
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([verl_row([png((1, 2, 3))])]), path)
    with pytest.raises(ValueError, match=r"row 0 of .*image 0 \(\d+ bytes\) is too large to open safely .*"
                                         "raise PIL.Image.MAX_IMAGE_PIXELS"):
        RLDataset(path, processor.tokenizer, config(), processor=processor)


def test_a_text_model_refuses_rows_with_images(tmp_path, processor):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([verl_row([png((1, 2, 3))])]), path)
    with pytest.raises(ValueError, match="row 0 of .* has 1 image.*the model is text-only"):
        RLDataset(path, processor.tokenizer, config())


def test_a_prompt_with_images_is_dropped_or_refused_when_too_long(tmp_path, processor):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([verl_row([png((1, 2, 3))]), verl_row([], text="short")]), path)
    dataset = RLDataset(path, processor.tokenizer, config(max_prompt_length=30, filter_overlong_prompts=True),
                        processor=processor)
    assert len(dataset) == 1 and dataset.num_filtered == 1
    with pytest.raises(ValueError, match="a prompt with images cannot be cut"):
        RLDataset(path, processor.tokenizer, config(max_prompt_length=30, filter_overlong_prompts=False,
                                                   truncation="left"), processor=processor)


def test_sft_conversations_with_images_expand_pads_untrained(tmp_path, processor):
    from reinforge.data.sft_dataset import SFTDataset, SFTLoader, pack_examples

    path = tmp_path / "sft.parquet"
    rows = [{"messages": [{"role": "user", "content": "<image>How many?"}, {"role": "assistant", "content": "3"}],
             "images": [png((255, 0, 0))]}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    dataset = SFTDataset([path], processor.tokenizer, max_length=128, processor=processor)
    example = dataset.examples[0]
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]},
         {"role": "assistant", "content": "3"}], tokenize=False)
    expected = processor(text=[text], images=[Image.open(io.BytesIO(png((255, 0, 0))))], return_tensors="pt")
    assert example.input_ids == expected["input_ids"][0].tolist()
    trained = [token for token, mask in zip(example.input_ids, example.loss_mask, strict=True) if mask]
    assert processor.tokenizer.decode(trained) == "3<|im_end|>"
    batch = SFTLoader(dataset.examples, 1, processor.tokenizer.pad_token_id, processor=processor).next_batch()
    assert batch[MULTI_MODAL_KEY][0]["image_grid_thw"].tolist() == [[1, 4, 4]]
    with pytest.raises(ValueError, match="cannot pack conversations with images"):
        pack_examples(dataset.examples, 256)


def test_sft_refuses_a_null_image_and_keeps_text_only_rows(tmp_path, processor):
    """A null entry of a conversation's images would give each later image to the placeholder before it (with no
    placeholder, as TRL's rows have, nothing else would notice); a null or empty column is a text-only row."""
    from reinforge.data.sft_dataset import SFTDataset

    conversation = [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": "3"}]
    path = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": conversation, "images": []},
                                         {"messages": conversation, "images": None}]), path)
    dataset = SFTDataset([path], processor.tokenizer, max_length=128, processor=processor)
    assert [example.images for example in dataset.examples] == [(), ()]
    pq.write_table(pa.Table.from_pylist([{"messages": conversation, "images": [None, png((255, 0, 0))]}]), path)
    with pytest.raises(ValueError, match=r"^row 0 of .*, column 'images': image 0 of 2 is null"):
        SFTDataset([path], processor.tokenizer, max_length=128, processor=processor)


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "<image>How many?"}, {"role": "assistant", "content": "<|image_pad|> 3"}],
     r"holds 2 '<\|image_pad\|>' tokens for its 1 image\(s\): its own text spells 1"),
    ([{"role": "system", "content": "count"}, {"role": "assistant", "content": "3"}],
     r"holds 0 '<\|image_pad\|>' tokens for its 1 image\(s\): the chat template rendered no place for 1 of them"),
])
def test_sft_refuses_an_image_without_its_place_in_the_text(tmp_path, processor, messages, message):
    """Text spelling the image token would take an image's place; an image the template gives no place (no
    placeholder and no user message to open) would be trained on unseen."""
    from reinforge.data.sft_dataset import SFTDataset

    path = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": messages, "images": [png((255, 0, 0))]}]), path)
    with pytest.raises(ValueError, match=rf"^row 0 of .*: its rendered text {message}"):
        SFTDataset([path], processor.tokenizer, max_length=128, processor=processor)


def vlm_run(tmp_path, rows: list[dict]) -> list[str]:
    """Overrides of a GRPO run of a tiny VLM on ``rows`` (written to a parquet file), on the CPU."""
    from reinforge.demo import vision_reward
    from reinforge.models.tiny_vlm import save_tiny_vlm

    model = save_tiny_vlm(tmp_path / "vlm")
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return [f"model.path={model}", f"data.train_files=[{path}]", "data.train_batch_size=2", "trainer.device=cpu",
            f"trainer.output_dir={tmp_path / 'run'}", "reward.num_workers=0",
            f"reward.custom_function={vision_reward.__file__}:compute_score"]


def test_a_vision_language_run_with_a_critic_is_refused_before_any_model_loads(tmp_path):
    from reinforge.config import ConfigError, load_config
    from reinforge.trainer.preflight import preflight

    overrides = vlm_run(tmp_path, [verl_row([png((1, 2, 3))]) for _ in range(4)])
    with pytest.raises(ConfigError, match="vision-language model, whose critic reinforge does not build"):
        preflight(load_config(None, [*overrides, "algorithm.adv_estimator=gae"]))
    checked = preflight(load_config(None, [*overrides, "algorithm.adv_estimator=grpo", "rollout.n=2"]))
    assert checked.train_set.processor is not None and checked.train_set[0].images


def test_a_vision_language_runs_memory_plan_counts_the_image_tokens_of_its_rows(tmp_path):
    """data.max_image_tokens unset: the plan counts the most image tokens a row holds (a 64 x 64 image: 16 tokens
    of the tiny processor), not every prompt token; set, the rows must keep to it."""
    from reinforge.config import load_config
    from reinforge.trainer.preflight import preflight
    from reinforge.workers.memory_settings import run_shape

    overrides = vlm_run(tmp_path, [verl_row([png((1, 2, 3))]), verl_row([png((1, 2, 3), size=(64, 64))])] * 2)
    counted = load_config(None, [*overrides, "rollout.n=2"])
    preflight(counted)
    assert counted.data.max_image_tokens == 16 and run_shape(counted).image_tokens == 16
    assert counted.actor.max_tokens_per_micro_batch != "auto"  # the plan resolved its settings
    given = load_config(None, [*overrides, "rollout.n=2", "data.max_image_tokens=20"])
    preflight(given)
    assert given.data.max_image_tokens == 20
    with pytest.raises(ValueError, match=r"row 1 of .* has 16 image tokens, more than data.max_image_tokens=8"):
        preflight(load_config(None, [*overrides, "rollout.n=2", "data.max_image_tokens=8"]))


def test_data_max_pixels_resizes_the_images_of_prompts_rollouts_and_tools_alike(tmp_path):
    """A 64 x 64 image is 16 image tokens of the tiny processor; under data.max_pixels=1024 it is scaled to 32 x 32,
    4 tokens, in the prompt's ids, in the pixels the batch carries to the rollout and the training passes, and in
    the rollout's processor of tool images."""
    from reinforge.config import load_config
    from reinforge.trainer.preflight import preflight
    from reinforge.workers.rollout_side import _vision_processor

    overrides = [*vlm_run(tmp_path, [verl_row([png((1, 2, 3), size=(64, 64))])] * 4), "rollout.n=2"]
    default = load_config(None, overrides)
    preflight(default)
    assert default.data.max_image_tokens == 16
    bounded = load_config(None, [*overrides, "data.max_pixels=1024"])
    train_set = preflight(bounded).train_set
    assert bounded.data.max_image_tokens == 4
    assert train_set[0].prompt_ids.count(train_set.processor.image_token_id) == 4
    assert train_set.image_inputs(train_set[0])["image_grid_thw"].tolist() == [[1, 4, 4]]
    tool_images = _vision_processor(bounded).image_processor(images=[Image.new("RGB", (64, 64))], return_tensors="pt")
    assert tool_images["image_grid_thw"].tolist() == [[1, 4, 4]]
    raised = preflight(load_config(None, [*overrides, "data.min_pixels=4096"])).train_set.processor
    small = raised.image_processor(images=[Image.new("RGB", (32, 32))], return_tensors="pt")
    assert small["image_grid_thw"].tolist() == [[1, 8, 8]]  # 32 x 32 scaled up to 64 x 64
    with pytest.raises(ValueError, match=r"^data.max_pixels=100 is below the min_pixels=256 of .*vlm \(its "
                                         r"preprocessor_config.json\), so no image size fits both; set "
                                         "data.min_pixels to at most 100 too"):
        preflight(load_config(None, [*overrides, "data.max_pixels=100"]))


def test_sft_data_max_pixels_reaches_its_processor(tmp_path):
    from reinforge.config.loader import load_sft_config
    from reinforge.data.sft_dataset import SFTDataset
    from reinforge.models.tiny_vlm import save_tiny_vlm
    from reinforge.models.vision import run_processor

    model = save_tiny_vlm(tmp_path / "vlm")
    path = tmp_path / "sft.parquet"
    rows = [{"messages": [{"role": "user", "content": "<image>How many?"}, {"role": "assistant", "content": "3"}],
             "images": [png((255, 0, 0), size=(64, 64))]}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    counts = []
    for overrides in ([], ["data.max_pixels=1024"]):
        config = load_sft_config(None, [f"model.path={model}", f"data.train_files=[{path}]", *overrides])
        processor = run_processor(config.model, config.data)
        example = SFTDataset([path], processor.tokenizer, max_length=128, processor=processor).examples[0]
        counts.append(example.input_ids.count(processor.image_token_id))
    assert counts == [16, 4]


def test_an_sft_run_loads_its_image_processor_once(tmp_path, monkeypatch):
    """preflight_sft checks the pixel bounds on the processor the trainer then uses, not on one loaded beside it."""
    from transformers.image_processing_base import ImageProcessingMixin

    from reinforge.config.loader import load_sft_config
    from reinforge.models.tiny_vlm import save_tiny_vlm
    from reinforge.trainer.sft_trainer import SFTTrainer

    model = save_tiny_vlm(tmp_path / "vlm")
    path = tmp_path / "sft.parquet"
    rows = [{"messages": [{"role": "user", "content": "<image>How many?"}, {"role": "assistant", "content": "3"}],
             "images": [png((255, 0, 0), size=(64, 64))]}] * 2
    pq.write_table(pa.Table.from_pylist(rows), path)
    config = load_sft_config(None, [f"model.path={model}", f"data.train_files=[{path}]", "data.max_pixels=1024",
                                    "data.batch_size=2", "trainer.device=cpu", "trainer.loggers=[jsonl]",
                                    f"trainer.output_dir={tmp_path / 'run'}"])
    loaded = []
    from_dict = ImageProcessingMixin.from_dict.__func__
    monkeypatch.setattr(ImageProcessingMixin, "from_dict",
                        classmethod(lambda cls, *args, **kwargs: loaded.append(cls) or from_dict(cls, *args, **kwargs)))
    trainer = SFTTrainer(config)
    assert len(loaded) == 1 and trainer.processor.image_processor.size["longest_edge"] == 1024


@pytest.mark.parametrize("overrides, message", [
    (["data.max_pixels=0"], r"^data.max_pixels=0 is not a positive whole number of pixels; give one"),
    (["data.min_pixels=-4"], r"^data.min_pixels=-4 is not a positive whole number of pixels"),
    (["data.min_pixels=2048", "data.max_pixels=1024"],
     r"^data.min_pixels=2048 is more than data.max_pixels=1024; an image cannot be resized to both"),
])
@pytest.mark.parametrize("command", ["train", "sft"])
def test_pixel_bounds_are_checked_as_the_config_loads(overrides, message, command):
    from reinforge.config import ConfigError, load_config
    from reinforge.config.loader import load_sft_config

    with pytest.raises(ConfigError, match=message):
        (load_config if command == "train" else load_sft_config)(None, overrides)


@pytest.mark.parametrize("bounds, message", [
    (["data.min_pixels=100", "data.max_pixels=200"],
     r"^data.max_pixels=200 is below one merged patch of .*vlm \(16 x 16 = 256 pixels: patch_size=8 x merge_size=2\), "
     r"the smallest image its processor makes, which would give every image one token; set data.max_pixels to at "
     r"least 256$"),
    (["data.min_pixels=300", "data.max_pixels=500"],
     r"^data.min_pixels=300 leaves no whole number of merged patches \(16 x 16 = 256 pixels\) between min_pixels=300 "
     r"and max_pixels=500, and the processor resizes every image to whole merged patches, so it would break one "
     r"bound; set data.min_pixels to at most 256 or data.max_pixels to at least 512$"),
])
@pytest.mark.parametrize("command", ["train", "sft"])
def test_pixel_bounds_the_processor_cannot_keep_are_refused_before_the_model_loads(tmp_path, bounds, message, command):
    """The processor makes every image a whole number of merged patches (16 x 16 pixels for the tiny model): under
    max_pixels=200 it would still make each one such patch, and between 300 and 500 pixels it would make a small
    image 512 pixels; one line, from the model folder, before any model loads."""
    from reinforge.config import load_config
    from reinforge.config.loader import load_sft_config
    from reinforge.trainer.preflight import preflight, preflight_sft

    overrides = [*vlm_run(tmp_path, [verl_row([png((1, 2, 3))])] * 4), "rollout.n=2"]
    if command == "sft":  # the model folder and a data file are all its checks read
        overrides = [item for item in overrides if item.startswith(("model.path=", "data.train_files="))]
    check, load = (preflight, load_config) if command == "train" else (preflight_sft, load_sft_config)
    with pytest.raises(ValueError, match=message):
        check(load(None, [*overrides, *bounds]))
    check(load(None, [*overrides, "data.min_pixels=300", "data.max_pixels=512"]))  # two merged patches fit


def test_evaluation_and_the_rollouts_tool_images_are_resized_within_the_runs_pixel_bounds(tmp_path, monkeypatch):
    """reinforge eval's prompts, its actor's processor and the processor its rollout hands the agent loops (which
    turns the images tools return into tokens) all resize a 64 x 64 image to 32 x 32 under data.max_pixels=1024:
    4 image tokens, not the folder's 16."""
    from reinforge.config import load_config
    from reinforge.reward import data_checks
    from reinforge.trainer.evaluate import evaluate
    from reinforge.workers import actor_rollout

    overrides = vlm_run(tmp_path, [verl_row([png((1, 2, 3), size=(64, 64))])] * 2)
    overrides = [item.replace("data.train_files", "data.val_files") for item in overrides]
    datasets, workers = [], []
    scored = data_checks.check_rows_can_be_scored
    monkeypatch.setattr(data_checks, "check_rows_can_be_scored",
                        lambda dataset, *args: datasets.append(dataset) or scored(dataset, *args))

    class Recorded(actor_rollout.ActorRolloutWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            workers.append(self)

    monkeypatch.setattr(actor_rollout, "ActorRolloutWorker", Recorded)
    evaluate(load_config(None, [*overrides, "data.max_pixels=1024", "data.max_response_length=2",
                                "rollout.name=hf"]))
    [dataset], [worker] = datasets, workers
    assert dataset[0].prompt_ids.count(dataset.processor.image_token_id) == 4
    image = Image.new("RGB", (64, 64))
    for processor in (worker.processor, worker.rollout_side.agent_runner.processor):
        assert processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"].tolist() == [[1, 4, 4]]
