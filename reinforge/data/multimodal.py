"""Rows with images: reading them, checking them at load, and turning them into a VLM's inputs.

Two formats are read, for RL prompts and SFT conversations alike:

- verl's: an ``images`` column (a list; ``image`` for one) whose items are encoded bytes, PIL
  images, file paths (``file://`` ones too) or ``data:image/...;base64,`` URIs, or dicts holding
  one: ``{"bytes": ..., "path": ...}`` (the struct of datasets' Image feature in parquet: its bytes
  when present, else its path), ``{"image": ...}`` (verl's and qwen_vl_utils') or ``{"image_url":
  {"url": ...}}``; and one ``<image>`` placeholder in the prompt's text per image, in order;
- TRL's conversational one: messages whose ``content`` is a list of parts, ``{"type": "text",
  "text": ...}`` and ``{"type": "image"}`` (one per image of the ``images``/``image`` column, in
  order). A conversation with images and no image part at all gets them at the start of its first
  user message, as TRL does. A part may hold its image itself, as Qwen's and OpenAI's messages do
  (``{"type": "image", "image": ...}``, ``{"type": "image_url", "image_url": {"url": ...}}``): the
  parts' images are then the row's, in order, and the row has no image column besides.

``data.image_key`` names another column to read the images from (then only that one, and a row
without it is refused naming the key).

Every image is opened when the dataset is built: a missing file, bytes that are no image, a null
entry in a list of images (a null or empty column is a text-only row) and a count of images that
differs from the count of placeholders each raise one line naming the row, before any model loads.
The processor (``AutoProcessor``) renders nothing itself: the chat template renders the messages
(image parts become the model's vision tokens), and the processor resizes each image within its
pixel bounds (data.min_pixels, data.max_pixels: ``models.vision.set_pixel_bounds``), expands its
pad token to the image's number of merged patches and tokenizes; the prompt's token ids are those,
never text re-tokenized later. A dataset keeps each row's image *sources*,
not pixels (a 448 x 448 image is 4.8 MB of float32 pixel values), and ``image_inputs`` turns them
into pixel values when a batch is collated.

A batch carries the pixels in the non-tensor column ``protocol.MULTI_MODAL_KEY``: one dict per row,
``{"pixel_values": (patches, channels * temporal * patch * patch), "image_grid_thw": (images, 3)}``
({} for a row without images), which splits, repeats and concatenates with the batch's rows.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from reinforge.data.chat_template import apply_chat_template
from reinforge.data.files import as_list

IMAGE_PLACEHOLDER = "<image>"
"""verl's image placeholder in a prompt's text."""
IMAGE_COLUMNS = ("images", "image")
RESIZE_KEYS = frozenset({"min_pixels", "max_pixels", "resized_height", "resized_width"})
"""Per-image resize settings of verl's rows (qwen_vl_utils' fetch_image reads them), which reinforge refuses: one
pair of data.min_pixels and data.max_pixels resizes every image of a run."""
IMAGE_FORMS = ("encoded bytes, a PIL image, a file path, a data:image/...;base64 URI, or a dict holding one as "
               "{'bytes': ..., 'path': ...}, {'image': ...} or {'image_url': {'url': ...}}")
IMAGE_SOURCE_KEYS = ("bytes", "path", "image", "image_url", "url")
"""The keys of a dict that stands for an image, first found first read: datasets' Image struct ({"bytes", "path"}:
its bytes when present, else its path), verl's and Qwen's {"image": ...}, OpenAI's {"image_url": {"url": ...}}."""


def row_image_sources(row: dict[str, Any], image_key: str | None = None, where: str = "the row") -> list[Any]:
    """The row's images as given: the ``image_key`` column (data.image_key), or without one the ``images`` column,
    else ``image``; [] when it has none (a null column, or an empty list: a text-only row). A row that lacks a named
    column, and a null entry in a list of images (each entry stands for the image of one placeholder, in order:
    dropping it would give every later placeholder the image meant for the next one), raise one line naming the
    row and the column."""
    if image_key is not None and image_key not in row:
        columns = ", ".join(sorted(map(str, row))) or "none"
        raise ValueError(f"{where} has no {image_key!r} column (data.image_key); this row has: {columns}; set "
                         "data.image_key to the column that holds its images, or null to read 'images' or 'image'")
    for column in IMAGE_COLUMNS if image_key is None else (image_key,):
        value = row.get(column)
        if value is None:
            continue
        if isinstance(value, list | tuple) or (hasattr(value, "tolist") and not hasattr(value, "convert")):
            images = list(value)
            missing = [number for number, item in enumerate(images) if item is None]
            if missing:
                raise ValueError(f"{where}, column {column!r}: image {missing[0]} of {len(images)} is null, and each "
                                 "entry is the image of one placeholder, in order; give its image, or drop the entry "
                                 "and its placeholder")
            return images
        return [value]
    return []


def images_refused(where: str, num_images: int, column: str, why_no_images: str | None) -> ValueError:
    """The one-line error of a row with images whose model takes none (the dataset has no processor):
    ``why_no_images`` names the model, why and the fix (``models.vision.why_no_images``); None: a text-only model."""
    why = why_no_images or ("the model is text-only (it has no image processor); train a vision-language model "
                            "(Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or drop that column")
    return ValueError(f"{where} has {num_images} image(s) in its {column!r} column, but {why}")


def image_column(row: dict[str, Any], image_key: str | None = None) -> str:
    """The name of the column the row's images come from (for messages)."""
    if image_key is not None:
        return image_key
    return next((column for column in IMAGE_COLUMNS if row.get(column) is not None), IMAGE_COLUMNS[0])


def unwrapped_image(source: Any) -> Any:
    """The image a dict stands for (its first non-null ``IMAGE_SOURCE_KEYS``, unwrapped again while it is a dict),
    None when it holds none; any other source as it is."""
    while isinstance(source, dict):
        source = next((source[key] for key in IMAGE_SOURCE_KEYS if source.get(key) is not None), None)
    return source


def _image_bytes(source: Any) -> tuple[bytes | None, str | None]:
    """(encoded bytes, path) of a source that is not a dict or a PIL image; TypeError for another type, ValueError
    for a data URI that does not decode."""
    if isinstance(source, bytes | bytearray | memoryview):
        return bytes(source), None
    if isinstance(source, str) and source.startswith("data:"):
        header, _, payload = source.partition(",")
        if not header.endswith(";base64"):
            raise ValueError(f"its header {header!r} is not base64")
        return base64.b64decode(payload, validate=True), None
    if isinstance(source, str) and source.startswith("file://"):
        return None, source.removeprefix("file://")
    if isinstance(source, str | Path):
        return None, str(source)
    raise TypeError(type(source).__name__)


def to_rgb(image):
    """The PIL image in RGB, its transparent parts over white as transformers' image processors show them (a plain
    ``convert("RGB")`` would show them black, or whatever colour the transparent pixels hold)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def load_image(source: Any, where: str, number: int):
    """Image ``number`` (0-based) of the row at ``where`` as an RGB PIL image; one-line errors naming both.

    An encoded image is turned upright by its EXIF orientation, as ``datasets``' Image feature and transformers'
    ``load_image`` turn it; transparency is shown over white (``to_rgb``)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    resizes = sorted(RESIZE_KEYS.intersection(source)) if isinstance(source, dict) else []
    if any(source[key] is not None for key in resizes):
        raise ValueError(f"{where}: image {number} sets {', '.join(resizes)}, which reinforge does not apply per image "
                         "(verl's qwen_vl_utils does); the processor resizes every image within data.min_pixels and "
                         "data.max_pixels (unset: the model folder's preprocessor_config.json): drop these keys and set "
                         "those, or resize the image before storing it")
    given = unwrapped_image(source)
    if given is None:
        keys = ", ".join(repr(key) for key, value in source.items() if value is not None) or "only null values"
        raise ValueError(f"{where}: image {number} is a dict with {keys} and no image; give each image as "
                         f"{IMAGE_FORMS}")
    if isinstance(given, Image.Image):
        return _within_aspect_ratio(to_rgb(given), where, number)
    if isinstance(given, str) and given.startswith(("http://", "https://")):
        raise ValueError(f"{where}: image {number} is the web address {given[:80]}, and reinforge downloads "
                         "nothing; download the image and give its file path or bytes")
    try:
        data, path = _image_bytes(given)
    except TypeError:
        raise ValueError(f"{where}: image {number} is a {type(given).__name__}; give each image as "
                         f"{IMAGE_FORMS}") from None
    except ValueError as error:  # a malformed base64 URI
        raise ValueError(f"{where}: image {number} is a data URI that does not decode ({error}); give it as "
                         f"{IMAGE_FORMS}") from None
    if data is None:
        file = Path(path).expanduser()
        if not file.is_file():
            raise ValueError(f"{where}: image {number} is the file {file}, which does not exist; fix the path "
                             "(a relative path is read from the current folder) or drop the image")
        data = file.read_bytes()
    origin = f"the file {path}" if path else f"{len(data)} bytes"
    try:
        with Image.open(io.BytesIO(data)) as image:
            opened = to_rgb(ImageOps.exif_transpose(image))
    except Image.DecompressionBombError as error:
        raise ValueError(f"{where}: image {number} ({origin}) is too large to open safely ({error}); shrink it "
                         "(the processor resizes it to at most its max_pixels anyway) or raise PIL.Image.MAX_IMAGE_PIXELS "
                         "if it is trusted") from None
    except (UnidentifiedImageError, OSError, ValueError) as error:
        fix = "re-encode it as PNG or JPEG"
        if path is None and _reads_as_path(data):  # parquet stores a path among bytes as the path's bytes
            fix = (f"its bytes are the text {data.decode()!r}, a file path: a parquet column that holds bytes stores "
                   "a path as its bytes; store every image of the column alike, as bytes, as paths, or as "
                   "{'bytes': ..., 'path': ...} structs (datasets' Image feature)")
        raise ValueError(f"{where}: image {number} ({origin}) cannot be read as an image ({error}); {fix}") from None
    return _within_aspect_ratio(opened, where, number)


MAX_ASPECT_RATIO = 200
"""The longest side over the shortest that the Qwen-VL image processors resize (they refuse a longer strip)."""


def _within_aspect_ratio(image: Any, where: str, number: int) -> Any:
    width, height = image.size
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ValueError(f"{where}: image {number} is {width} x {height} pixels, a strip whose long side is more than "
                         f"{MAX_ASPECT_RATIO} times its short side, which the image processor cannot resize; pad or "
                         "crop it nearer to a square")
    return image


def _reads_as_path(data: bytes) -> bool:
    """Whether ``data`` is the UTF-8 text of a file path (one line, a few hundred bytes at most, with a file
    extension)."""
    if len(data) > 1024:
        return False
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return False
    return text.isprintable() and bool(Path(text).suffix)


def load_images(sources: Sequence[Any], where: str) -> list[Any]:
    """The images opened (so that a broken one fails at load); ``where`` names the row and the column."""
    return [load_image(source, where, number) for number, source in enumerate(sources)]


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") in ("image", "image_url") or "image" in part
                                       and part.get("type") is None)


def take_part_images(messages: Any) -> tuple[Any, list[dict[str, Any]]]:
    """The chat messages with every content part's null keys dropped, and each image part that holds its image
    (``{"type": "image", "image": ...}``, ``{"type": "image_url", "image_url": {"url": ...}}``) made a bare
    ``{"type": "image"}``; and those parts (without their null keys), in order: the images' sources. Anything but
    a list of messages comes back as it is, with no images.

    Parquet gives every part of a list each key any part has: a text part's ``"image": None`` would otherwise be an
    image to a chat template that asks ``'image' in part`` (Qwen2-VL's does)."""
    if not isinstance(messages, list):
        return messages, []
    sources: list[dict[str, Any]] = []
    converted = []
    for message in messages:
        content = as_list(message.get("content")) if isinstance(message, dict) else None
        if not isinstance(content, list):
            converted.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict):
                part = {key: value for key, value in part.items() if value is not None}
                if _is_image_part(part) and unwrapped_image(part) is not None:
                    sources.append(part)
                    part = {"type": "image"}
            parts.append(part)
        converted.append({**message, "content": parts})
    return converted, sources


def row_images(row: dict[str, Any], message_keys: Sequence[str], image_key: str | None,
               where: str) -> tuple[dict[str, Any], list[Any], str]:
    """(the row with the messages of its ``message_keys`` columns as ``take_part_images`` gives them, the row's image
    sources, the column they come from): the image parts' own images, else the image column's
    (``row_image_sources``). A row with images in both raises one line: which image meets which part is unsaid."""
    sources = row_image_sources(row, image_key, where)
    column = image_column(row, image_key)
    row = dict(row)
    in_parts: list[Any] = []
    part_columns: list[str] = []
    for key in message_keys:
        if key in row:
            row[key], found = take_part_images(as_list(row[key]))
            in_parts += found
            part_columns += [key] if found else []
    if not in_parts:
        return row, sources, column
    if sources:
        raise ValueError(f"{where} has {len(in_parts)} image(s) in the content parts of its {part_columns[0]!r} and "
                         f"{len(sources)} in its {column!r} column; give each image once: in its part "
                         f"({{'type': 'image', 'image': ...}}), or in {column!r} with a bare {{'type': 'image'}} part")
    return row, in_parts, part_columns[0]


def count_image_placeholders(prompt: list[dict[str, Any]] | str) -> int:
    """``<image>`` placeholders in the prompt's text plus ``{"type": "image"}`` content parts."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    count = 0
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            count += content.count(IMAGE_PLACEHOLDER)
        elif isinstance(content, list):
            for part in content:
                if _is_image_part(part):
                    count += 1
                elif isinstance(part, dict) and isinstance(part.get("text"), str):
                    count += part["text"].count(IMAGE_PLACEHOLDER)
    return count


def _split_placeholders(text: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for number, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if number:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def with_image_parts(messages: list[dict[str, Any]], num_images: int) -> list[dict[str, Any]]:
    """The messages with every ``<image>`` of their text as an image part; with no placeholder at all,
    ``num_images`` image parts open the first user message (TRL's convention)."""
    placed = count_image_placeholders(messages)
    converted = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            content = _split_placeholders(content)
        elif isinstance(content, list):
            content = [piece for part in content for piece in
                       (_split_placeholders(part["text"]) if isinstance(part, dict) and part.get("type") == "text"
                        and IMAGE_PLACEHOLDER in str(part.get("text", "")) else [part])]
        converted.append({**message, "content": content})
    if placed == 0 and num_images:
        for message in converted:
            if message.get("role") == "user":
                text = message["content"]
                parts = [{"type": "text", "text": text}] if isinstance(text, str) else list(text or [])
                message["content"] = [{"type": "image"} for _ in range(num_images)] + parts
                break
    return converted


def check_image_count(prompt: list[dict[str, Any]] | str, num_images: int, where: str) -> None:
    """One line naming the row when the prompt's placeholders do not match its images (none at all is TRL's
    convention for conversations, and fine there)."""
    placeholders = count_image_placeholders(prompt)
    if placeholders == num_images or (placeholders == 0 and not isinstance(prompt, str) and num_images):
        return
    raise ValueError(f"{where} has {num_images} image(s) but {placeholders} image placeholder(s) in its prompt "
                     f"({IMAGE_PLACEHOLDER!r} in the text or {{'type': 'image'}} content parts); give one placeholder "
                     "per image, in the images' order")


def message_text_only(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with list contents joined into their text (image parts dropped): what a scorer or a judge reads."""
    return [{**message, "content": "".join(part.get("text", "") for part in message["content"]
                                          if isinstance(part, dict))}
            if isinstance(message.get("content"), list) else message for message in messages]


def render_with_images(processor: Any, prompt: list[dict[str, Any]] | str, num_images: int,
                       chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
                       add_generation_prompt: bool = True) -> str:
    """The prompt's text with the model's vision tokens where its images go (one pad token per image, which the
    processor expands)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    messages = with_image_parts(messages, num_images)
    template = chat_template or getattr(processor, "chat_template", None) \
        or getattr(processor.tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the processor has no chat template; set data.chat_template to a Jinja template that "
                         "renders image content parts")
    return apply_chat_template(processor.tokenizer, messages, chat_template=template, tokenize=False,
                               add_generation_prompt=add_generation_prompt, tools=tools or None)


def check_image_places(num_places: int, num_images: int, token: str) -> None:
    """One line (its row named by the caller) when the rendered text holds another number of the image token
    ``token`` than the row has images: text of the row's own that spells the token would take an image's place,
    and a chat template that renders no image part (images without placeholders go to the first user message:
    a conversation without one) would drop the image unseen."""
    if num_places == num_images:
        return
    if num_places > num_images:
        raise ValueError(f"its rendered text holds {num_places} {token!r} tokens for its {num_images} image(s): its "
                         f"own text spells {num_places - num_images} {token!r}, the model's image token, which "
                         "would take an image's place; remove or reword that text")
    raise ValueError(f"its rendered text holds {num_places} {token!r} tokens for its {num_images} image(s): the "
                     f"chat template rendered no place for {num_images - num_places} of them (images without a "
                     "placeholder open the first user message: give the row one, or one placeholder per image; a "
                     "data.chat_template must render {'type': 'image'} content parts)")


def text_and_images_ids(processor: Any, text: str, images: Sequence[Any]) -> list[int]:
    """The processor's token ids for ``text``, each image pad token repeated once per merged patch of its image. The
    counts come from the images' sizes where the image processor counts them so (Qwen2-VL's): its pixels are
    processed when a batch holds them, not here too."""
    if not images:
        return list(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    token = getattr(processor, "image_token", None) or "<|image_pad|>"
    check_image_places(text.count(token), len(images), token)
    if not hasattr(processor.image_processor, "get_number_of_image_patches"):
        outputs = processor(text=[text], images=list(images), return_tensors="pt", add_special_tokens=False)
        return outputs["input_ids"][0].tolist()
    first, *rest = text.split(token)
    expanded = first + "".join(token * count + part for count, part in zip(images_tokens(processor, images), rest,
                                                                            strict=True))
    return list(processor.tokenizer(expanded, add_special_tokens=False)["input_ids"])


def images_tokens(processor: Any, images: Sequence[Any]) -> list[int]:
    """Each image's tokens: the image processor's own count of its merged patches, from the image's size where it
    counts them so (Qwen2-VL's, ``image_tokens_of_size``), else from its output (every pixel processed)."""
    image_processor = processor.image_processor
    if hasattr(image_processor, "get_number_of_image_patches"):
        return [image_tokens_of_size(image_processor, image.width, image.height) for image in images]
    merge = image_processor.merge_size
    return (image_inputs(processor, images)["image_grid_thw"].prod(-1) // (merge * merge)).tolist()


def image_tokens_of_size(image_processor: Any, width: int, height: int) -> int:
    """The language model's tokens for one ``width`` x ``height`` image as ``image_processor`` (Qwen2-VL's, as
    Qwen2.5-VL and Qwen3-VL use it) makes them: its own count of the image's patches once resized to whole merged
    patches within its pixel bounds (``size``), over merge_size^2. Raises ValueError where the processor refuses
    the image's shape (sides more than 200 times apart)."""
    merge = image_processor.merge_size
    return image_processor.get_number_of_image_patches(height, width, {}) // (merge * merge)


def image_marker(processor: Any) -> str:
    """The text that stands for one image before the processor expands it: Qwen's
    ``<|vision_start|><|image_pad|><|vision_end|>``."""
    start = getattr(processor, "vision_start_token", None) or "<|vision_start|>"
    end = getattr(processor, "vision_end_token", None) or "<|vision_end|>"
    return f"{start}{getattr(processor, 'image_token', None) or '<|image_pad|>'}{end}"


def encode_multimodal_prompt(processor: Any, prompt: list[dict[str, Any]] | str, images: Sequence[Any],
                             chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
                             templated: bool = True) -> list[int]:
    """A prompt with images: its token ids, as the processor makes them (``text_and_images_ids``). A string prompt
    that is not templated is the model's input as it is, its ``<image>`` placeholders made the model's image
    markers."""
    if templated:
        text = render_with_images(processor, prompt, len(images), chat_template, tools)
    elif isinstance(prompt, str):
        text = prompt.replace(IMAGE_PLACEHOLDER, image_marker(processor))
    else:
        raise ValueError("a chat-message prompt needs a chat template, but data.apply_chat_template is false; "
                         "set it to true or store prompts as strings")
    return text_and_images_ids(processor, text, images)


def image_inputs(processor: Any, images: Sequence[Any]) -> dict[str, Tensor]:
    """``{"pixel_values", "image_grid_thw"}`` of opened images, as the processor makes them; {} for none."""
    if not images:
        return {}
    outputs = processor.image_processor(images=list(images), return_tensors="pt")
    return {"pixel_values": outputs["pixel_values"], "image_grid_thw": outputs["image_grid_thw"]}


def concat_image_inputs(rows: Sequence[dict[str, Tensor] | None]) -> dict[str, Tensor]:
    """The image inputs of several rows as one (patches and grids concatenated in row order); {} for none."""
    present = [row for row in rows if row]
    if not present:
        return {}
    return {"pixel_values": torch.cat([row["pixel_values"] for row in present]),
            "image_grid_thw": torch.cat([row["image_grid_thw"] for row in present])}


def num_image_tokens(inputs: dict[str, Tensor] | None, merge_size: int) -> int:
    """The language-model tokens of these images: each image's merged patches."""
    if not inputs:
        return 0
    return int(inputs["image_grid_thw"].prod(-1).sum()) // (merge_size * merge_size)
