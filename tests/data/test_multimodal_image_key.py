import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from reinforge.config.errors import ConfigError
from reinforge.config.schema import DataConfig
from reinforge.config.validate import validate_image_key
from reinforge.data.rl_dataset import RLDataset
from reinforge.data.sft_dataset import SFTDataset
from reinforge.models.tiny_vlm import build_tiny_processor


@pytest.fixture(scope="module")
def processor():
    return build_tiny_processor("qwen2_5_vl")


def png(color) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buffer, format="PNG")
    return buffer.getvalue()


def row(**columns):
    return {"prompt": [{"role": "user", "content": "<image>How many red squares?"}],
            "reward_model": {"ground_truth": "1"}, **columns}


def write(tmp_path, rows):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_images_are_read_from_the_column_image_key_names(tmp_path, processor):
    path = write(tmp_path, [row(pictures=[png((255, 0, 0))], images=[png((0, 0, 255)), png((0, 255, 0))])])
    dataset = RLDataset(path, processor.tokenizer, DataConfig(max_prompt_length=256, image_key="pictures"),
                        processor=processor)
    assert dataset[0].images == (png((255, 0, 0)),)  # not the two of 'images'
    assert dataset[0].prompt_ids.count(processor.image_token_id) == 4
    with pytest.raises(ValueError, match=r"has 2 image\(s\) but 1 image placeholder"):  # the default reads 'images'
        RLDataset(path, processor.tokenizer, DataConfig(max_prompt_length=256), processor=processor)


def test_a_row_without_the_named_column_is_refused_naming_the_key(tmp_path, processor):
    path = write(tmp_path, [row(images=[png((255, 0, 0))])])
    with pytest.raises(ValueError, match=r"row 0 of .* has no 'pictures' column \(data.image_key\); this row has: "
                                         r"images, prompt, reward_model"):
        RLDataset(path, processor.tokenizer, DataConfig(image_key="pictures"), processor=processor)


def test_errors_about_an_image_name_its_column(tmp_path, processor):
    path = write(tmp_path, [row(pictures=[b"not an image"])])
    with pytest.raises(ValueError, match=r"row 0 of .*, column 'pictures': image 0 \(12 bytes\) cannot be read"):
        RLDataset(path, processor.tokenizer, DataConfig(image_key="pictures"), processor=processor)
    path = write(tmp_path, [row(pictures=[png((1, 2, 3))])])
    with pytest.raises(ValueError, match=r"has 1 image\(s\) in its 'pictures' column, but the model is text-only"):
        RLDataset(path, processor.tokenizer, DataConfig(image_key="pictures"))


def test_sft_conversations_read_the_named_column(tmp_path, processor):
    messages = [{"role": "user", "content": "<image>How many?"}, {"role": "assistant", "content": "1"}]
    path = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": messages, "pictures": [png((255, 0, 0))]}]), path)
    dataset = SFTDataset([path], processor.tokenizer, max_length=256, processor=processor, image_key="pictures")
    assert dataset.examples[0].input_ids.count(processor.image_token_id) == 4
    with pytest.raises(ValueError, match=r"row 0 of .* has no 'imgs' column \(data.image_key\)"):
        SFTDataset([path], processor.tokenizer, max_length=256, processor=processor, image_key="imgs")


def test_image_key_is_checked_in_the_config():
    validate_image_key(None, "prompt", "prompt_key")
    validate_image_key("pictures", "prompt", "prompt_key")
    with pytest.raises(ConfigError, match="data.image_key='prompt' is also data.prompt_key"):
        validate_image_key("prompt", "prompt", "prompt_key")
    with pytest.raises(ConfigError, match="data.image_key='' is not a column name"):
        validate_image_key("", "prompt", "prompt_key")


def test_a_prompt_with_more_image_tokens_than_data_max_image_tokens_is_refused_naming_the_row(tmp_path, processor):
    """The memory plan counts the vision tower's patches by data.max_image_tokens: a prompt holding more is refused
    as it loads (a 32 x 32 image is 4 image tokens of the tiny processor)."""
    path = write(tmp_path, [row(images=[png((255, 0, 0))])])
    dataset = RLDataset(path, processor.tokenizer, DataConfig(max_prompt_length=256, max_image_tokens=4),
                        processor=processor)
    assert dataset[0].prompt_ids.count(processor.image_token_id) == 4
    with pytest.raises(ValueError, match=r"row 0 of .* has 4 image tokens, more than data.max_image_tokens=3, by "
                                         r"which the memory plan counts the vision tower's patches; raise"):
        RLDataset(path, processor.tokenizer, DataConfig(max_prompt_length=256, max_image_tokens=3), processor=processor)
