"""A tool that returns an image (a crop of the prompt's image) to a tiny Qwen2.5-VL: its turn's image tokens are
appended and masked like any tool output, its pixels join the trajectory's images, and the native engine's
next turn sees both images: its log-probs are those of a transformers forward over the whole trajectory."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from PIL import Image

from reinforge.agent import AgentContext, BaseTool, ToolResult, get_agent_loop
from reinforge.agent.runner import AsyncEngineClient
from reinforge.config.schema import MultiTurnConfig
from reinforge.models.tiny_vlm import build_tiny_processor, build_tiny_vlm
from reinforge.protocol import MULTI_MODAL_KEY
from reinforge.rollout.base import Completion, SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.workers.agent_rollout import agent_output_batch

CROP_SCHEMA = {"type": "function", "function": {
    "name": "crop", "description": "Crop a square of the image.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"},
                                                    "size": {"type": "integer"}}}}}


class CropTool(BaseTool):
    """Returns the square of the row's image (create_kwargs ``image``) at x, y of side ``size``."""

    def __init__(self):
        super().__init__(schema=CROP_SCHEMA)
        self.images: dict[str, Image.Image] = {}

    async def create(self, instance_id=None, image=None, **create_kwargs):
        instance = await super().create(instance_id)
        self.images[instance] = image
        return instance

    async def execute(self, instance_id, arguments, **execute_kwargs):
        x, y, size = arguments["x"], arguments["y"], arguments["size"]
        return ToolResult(f"crop at {x},{y}", images=(self.images[instance_id].crop((x, y, x + size, y + size)),))


class FirstTurnScripted:
    """The first turn is a scripted tool call; later turns are the engine's (through ``AsyncEngineClient``)."""

    def __init__(self, tokenizer, engine, call_text: str):
        self.tokenizer, self.engine = tokenizer, AsyncEngineClient(engine)
        self.call_text = call_text
        self.requests: list[tuple[list[int], dict | None]] = []

    async def generate(self, prompt_ids, sampling, request_id, multi_modal_inputs=None):
        self.requests.append((list(prompt_ids), multi_modal_inputs))
        if len(self.requests) == 1:
            ids = self.tokenizer(self.call_text, add_special_tokens=False)["input_ids"]
            ids += [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
            return Completion(ids, [-0.5] * len(ids), "stop")
        return await self.engine.generate(prompt_ids, sampling, request_id, multi_modal_inputs)


@pytest.fixture(scope="module")
def vlm():
    return build_tiny_vlm("qwen2_5_vl"), build_tiny_processor("qwen2_5_vl")


def prompt_of(processor, image: Image.Image) -> dict:
    content = [{"type": "image"}, {"type": "text", "text": "count"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return dict(processor(text=[text], images=[image], return_tensors="pt"))


def run_trajectory(vlm, client, image, processor_in_context=True, max_tokens=300):
    model, processor = vlm
    prompt = prompt_of(processor, image)
    context = AgentContext(processor.tokenizer, client, MultiTurnConfig(max_assistant_turns=2), {"crop": CropTool()},
                           processor=processor if processor_in_context else None)
    row = {"prompt_ids": prompt["input_ids"][0].tolist(), "extra_info": {"tools_kwargs": {"crop": {
        "create_kwargs": {"image": image}}}}, MULTI_MODAL_KEY: {key: prompt[key] for key in ("pixel_values",
                                                                                               "image_grid_thw")}}
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=5)
    return prompt, asyncio.run(get_agent_loop("tool_agent")(context).run(sampling, **row))


def test_a_cropped_image_is_appended_masked_and_seen_by_the_next_turn(vlm):
    model, processor = vlm
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 48, 3), dtype=np.uint8))
    call = "<tool_call>\n" + json.dumps({"name": "crop", "arguments": {"x": 8, "y": 8, "size": 32}}) + "\n</tool_call>"
    engine = NativeEngine(model, eos_token_ids=[processor.tokenizer.eos_token_id], max_model_len=512, block_size=8,
                          max_num_seqs=4)
    client = FirstTurnScripted(processor.tokenizer, engine, call)
    prompt, output = run_trajectory(vlm, client, image)
    image_token = model.config.image_token_id
    merge = model.config.vision_config.spatial_merge_size

    images = output.multi_modal_inputs
    grids = images["image_grid_thw"]
    assert grids.tolist() == [prompt["image_grid_thw"][0].tolist(), [1, 4, 4]]  # the 32 x 32 crop: 4 x 4 patches
    assert images["pixel_values"].shape[0] == int(grids.prod(-1).sum())
    response = torch.tensor(output.response_ids)
    mask = torch.tensor(output.response_mask)
    tool_pads = (response == image_token)
    assert int(tool_pads.sum()) == 16 // merge**2 and not mask[tool_pads].any()  # masked like any tool output
    # the second turn's request carried both images and the whole trajectory so far
    second_ids, second_images = client.requests[1]
    assert torch.equal(second_images["image_grid_thw"], grids)
    assert second_ids == output.prompt_ids + output.response_ids[:len(second_ids) - len(output.prompt_ids)]
    # what the engine sampled after the tool's image is what transformers gives the trajectory with both images
    ids = torch.tensor([output.prompt_ids + output.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=images["pixel_values"],
                       image_grid_thw=grids, mm_token_type_ids=(ids == image_token).long()).logits[0].float()
    start = len(output.prompt_ids)
    expected = torch.log_softmax(logits[start - 1:-1], dim=-1).gather(1, response[:, None])[:, 0]
    second_turn = slice(len(second_ids) - start, None)  # the engine's tokens (the first turn's were scripted)
    assert mask[second_turn].all() and len(response[second_turn]) > 0
    torch.testing.assert_close(torch.tensor(output.response_log_probs)[second_turn], expected[second_turn], atol=1e-5,
                               rtol=0)

    batch = agent_output_batch([output], len(output.prompt_ids), 300, processor.tokenizer.pad_token_id)
    assert torch.equal(batch.non_tensors[MULTI_MODAL_KEY][0]["image_grid_thw"], grids)


def test_an_image_from_a_tool_without_a_processor_is_refused_in_one_line(vlm):
    model, processor = vlm
    image = Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8))
    call = "<tool_call>\n" + json.dumps({"name": "crop", "arguments": {"x": 0, "y": 0, "size": 16}}) + "\n</tool_call>"
    engine = NativeEngine(model, eos_token_ids=[processor.tokenizer.eos_token_id], max_model_len=512, block_size=8,
                          max_num_seqs=4)
    with pytest.raises(ValueError, match="a tool returned an image, but this model takes no images: it has no image "
                                         "processor reinforge uses .a text model, or an image-text model reinforge "
                                         "trains on text alone"):
        run_trajectory(vlm, FirstTurnScripted(processor.tokenizer, engine, call), image, processor_in_context=False)


def test_a_tools_images_are_read_as_a_rows_are_and_an_unreadable_one_is_the_calls_error(tmp_path):
    """Bytes and file paths reached the processor as they were (transformers refused bytes, and would fetch a web
    address); a broken image stopped the rollout instead of answering the call."""
    import io

    from reinforge.agent.tools import as_tool_result

    picture = Image.new("RGBA", (6, 4), (255, 0, 0, 128))
    encoded = io.BytesIO()
    picture.save(encoded, format="PNG")
    (tmp_path / "crop.png").write_bytes(encoded.getvalue())
    result = as_tool_result(ToolResult("x", images=(encoded.getvalue(), str(tmp_path / "crop.png"), picture)))
    assert [(image.mode, image.size) for image in result.images] == [("RGB", (6, 4))] * 3
    assert as_tool_result(ToolResult("x", images=str(tmp_path / "crop.png"))).images[0].size == (6, 4)  # one, alone
    with pytest.raises(ValueError, match=r"^the tool's result: image 0 is the web address .* reinforge downloads "
                                         r"nothing"):
        as_tool_result(ToolResult("x", images=("https://example.com/a.png",)))
    with pytest.raises(ValueError, match=r"^the tool's result: image 1 \(3 bytes\) cannot be read as an image"):
        as_tool_result(ToolResult("x", images=(picture, b"abc")))


def test_a_tool_image_whose_turn_the_template_renders_without_it_is_one_line_naming_the_template(vlm):
    from reinforge.agent.tool_images import encode_with_images

    _, processor = vlm
    image = Image.new("RGB", (32, 32), (200, 10, 10))
    turn = "<|im_start|>user\n<tool_response>\n{}crop at 8,8\n</tool_response><|im_end|>\n"
    with pytest.raises(ValueError, match=r"a tool returned 1 image\(s\), but the chat template rendered its tool turn "
                                         r"with 0 '<\|image_pad\|>' token\(s\).* set data.chat_template"):
        encode_with_images(processor, turn.format(""), [image])
    marker = "<|vision_start|><|image_pad|><|vision_end|>"
    with pytest.raises(ValueError, match=r"its text spells 1 '<\|image_pad\|>'"):
        encode_with_images(processor, turn.format(marker + "<|image_pad|>"), [image])
    ids, inputs = encode_with_images(processor, turn.format(marker), [image])
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
