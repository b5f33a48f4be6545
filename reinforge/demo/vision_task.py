"""The vision demo's task: count the red squares in a small picture.

A picture is 32 x 32 pixels, a 2 x 2 grid of 16-pixel cells: each cell is 2 x 2 patches of the
tiny VLM's vision tower, merged into one language token. 1 to 3 cells hold a red square, the others
a blue square or nothing, at random. The question is ``<image>How many red squares?`` (verl's row
format: the picture in the ``images`` column, PNG bytes), the answer the count alone.

The SFT conversations the model starts from are flawed on purpose: ``sft_overcount_fraction`` of
them (60%) answer one more than the count, as a careless annotator might. The model learns to count
and learns the flaw: greedily it says one too many and gets most held-out pictures wrong, while
its samples are often right. GRPO, rewarded only for the exact count (``vision_reward.py``),
unlearns the flaw.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path

from reinforge.atomic_files import replaced_atomically

DATA_SOURCE = "count_red_squares"
QUESTION = "How many red squares?"
GRID = 2
CELL = 16
RED = (220, 30, 30)
BLUE = (30, 30, 220)


def draw_picture(rng: random.Random) -> tuple[bytes, int]:
    """(PNG bytes of a picture, its number of red squares)."""
    from PIL import Image, ImageDraw

    num_red = rng.randint(1, GRID * GRID - 1)
    num_blue = rng.randint(0, GRID * GRID - num_red)
    cells = rng.sample(range(GRID * GRID), num_red + num_blue)
    picture = Image.new("RGB", (GRID * CELL, GRID * CELL), (255, 255, 255))
    draw = ImageDraw.Draw(picture)
    for number, cell in enumerate(cells):
        left, top = (cell % GRID) * CELL, (cell // GRID) * CELL
        draw.rectangle([left + 2, top + 2, left + CELL - 3, top + CELL - 3], fill=RED if number < num_red else BLUE)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue(), num_red


@dataclass(frozen=True)
class VisionDemoTask:
    num_train: int = 2000
    num_test: int = 200
    num_sft: int = 4000
    sft_overcount_fraction: float = 0.6
    """Share of SFT answers that say one more than the count (the flaw RL fixes)."""
    seed: int = 0
    max_prompt_length: int = 64
    max_response_length: int = 4

    def rl_rows(self, count: int, rng: random.Random) -> list[dict]:
        rows = []
        for index in range(count):
            picture, num_red = draw_picture(rng)
            rows.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"<image>{QUESTION}"}],
                         "images": [{"bytes": picture, "path": None}], "ability": "vision",
                         "reward_model": {"style": "rule", "ground_truth": str(num_red)},
                         "extra_info": {"index": index}})
        return rows

    def sft_rows(self, rng: random.Random) -> list[dict]:
        rows = []
        for _ in range(self.num_sft):
            picture, num_red = draw_picture(rng)
            answer = num_red + 1 if rng.random() < self.sft_overcount_fraction else num_red
            rows.append({"messages": [{"role": "user", "content": f"<image>{QUESTION}"},
                                      {"role": "assistant", "content": str(answer)}],
                         "images": [{"bytes": picture, "path": None}]})
        return rows

    def write(self, out_dir: str | Path) -> dict[str, str]:
        """train.parquet and test.parquet (RL rows, fresh pictures each) and sft_train.parquet under ``out_dir``."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        rng = random.Random(self.seed)
        files = {}
        for name, rows in (("train", self.rl_rows(self.num_train, rng)), ("test", self.rl_rows(self.num_test, rng)),
                           ("sft_train", self.sft_rows(rng))):
            path = out_dir / f"{name}.parquet"
            with replaced_atomically(path, durable=False) as staging:
                pq.write_table(pa.Table.from_pylist(rows), staging)
            files[name] = str(path)
        return files


VISION_TASK = VisionDemoTask()
