"""The example configs, shipped with the package, and ``reinforge init``, which writes them into a folder.

``reinforge init`` writes every example into ``./examples``; ``reinforge init retool DIR`` writes one
(with the files it needs: ReTool's tool config, the reward model's and DPO's sample pairs) into ``DIR``. A config
names those files by paths relative to the working directory, so the copy written names the copies written beside
it.
A file already there is kept unless ``--force``: a config a user edited is never written over.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from reinforge.atomic_files import replaced_atomically

FOLDER = Path(__file__).resolve().parent

EXAMPLES: dict[str, tuple[str, ...]] = {
    "grpo_gsm8k": ("grpo_gsm8k.yaml",),
    "dapo_gsm8k": ("dapo_gsm8k.yaml",),
    "ppo_gsm8k": ("ppo_gsm8k.yaml",),
    "retool": ("retool.yaml", "retool_tools.yaml"),
    "rm": ("rm.yaml", "preference_pairs.jsonl", "preference_pairs_val.jsonl"),
    "dpo": ("dpo.yaml", "preference_pairs.jsonl", "preference_pairs_val.jsonl"),
}
"""An example's name -> its files in this folder, the config first."""

COMMANDS: dict[str, str] = {"rm": "rm", "dpo": "dpo"}
"""The reinforge command that runs an example's config, where it is not ``train``."""

SHIPPED_FOLDER = "examples"
"""The folder the shipped configs' relative paths assume (``tool_config_path: examples/retool_tools.yaml``)."""


def example_text(file_name: str, folder: Path) -> str:
    """The file's text as written into ``folder``: paths to the examples' own files point into ``folder``."""
    text = (FOLDER / file_name).read_text(encoding="utf-8")
    if folder.as_posix() == SHIPPED_FOLDER:
        return text
    # one pass over the text: a folder whose path holds examples/ (proj/examples) is not rewritten again
    names = sorted({name for files in EXAMPLES.values() for name in files}, key=len, reverse=True)
    shipped = re.compile("|".join(re.escape(f"{SHIPPED_FOLDER}/{name}") for name in names))
    return shipped.sub(lambda match: _yaml_path(folder / match.group().removeprefix(f"{SHIPPED_FOLDER}/")), text)


def _yaml_path(path: Path) -> str:
    """``path`` as YAML reads it back whole, in a list or after a key: quoted where it holds characters YAML reads
    otherwise (a folder named "my #runs" or "a, b")."""
    text = path.as_posix()
    return json.dumps(text) if re.search(r"[#,\[\]{}:&*!|>'\"%@`]|^[-?\s]|\s$", text) else text


def _written_already(path: Path, text: str) -> bool:
    """Whether ``path`` is a file holding ``text`` already."""
    try:
        return path.is_file() and path.read_text(encoding="utf-8") == text
    except (OSError, UnicodeDecodeError):
        return False


def write_examples(names: list[str], folder: Path, force: bool = False) -> list[Path]:
    """Write the files of the examples ``names`` into ``folder`` (made if missing); returns the paths written.

    A file already there with the text it would get is left as it is (``init rm`` then ``init dpo`` share their
    sample pairs). Raises FileExistsError, naming the files, when others are there already (and ``force`` is not
    set); then nothing is written."""
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} is a file, not a folder; reinforge init writes the examples into a folder: "
                              "give another one")
    texts = {name: example_text(name, folder) for example in names for name in EXAMPLES[example]}  # shared pairs once
    if not force:
        texts = {name: text for name, text in texts.items() if not _written_already(folder / name, text)}
    present = [folder / name for name in texts if (folder / name).exists()]
    if present and not force:
        raise FileExistsError(f"{', '.join(str(path) for path in present)} already exist(s); reinforge init keeps "
                              "them: pass --force to write over them, or another folder")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in texts.items():
        path = folder / name
        with replaced_atomically(path, durable=False) as temporary:
            temporary.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def init_main(argv: list[str]) -> int:
    """``reinforge init [NAME|all] [DIR] [--force]``."""
    parser = argparse.ArgumentParser(
        prog="reinforge init", description="Write the example configs (GRPO, DAPO, PPO on GSM8K; the ReTool recipe "
        "with its tool config; a reward model and DPO on sample pairs) into a folder, to train with or start from.")
    parser.add_argument("name", nargs="?", default="all", help=f"one of {', '.join(EXAMPLES)}, or all (default)")
    parser.add_argument("folder", nargs="?", default=SHIPPED_FOLDER, help="where to write them (default: examples)")
    parser.add_argument("--force", action="store_true", help="write over files already there")
    args = parser.parse_args(argv)
    if args.name not in (*EXAMPLES, "all"):
        raise ValueError(f"reinforge init {args.name}: no example of that name; the examples are "
                         f"{', '.join(EXAMPLES)} (or all); reinforge init all DIR writes them all into DIR")
    names = list(EXAMPLES) if args.name == "all" else [args.name]
    folder = Path(args.folder)
    for path in write_examples(names, folder, args.force):
        print(f"wrote {path}")
    config = folder / EXAMPLES[names[0]][0]
    command = COMMANDS.get(names[0], "train")
    data = " data.train_files=[...]" if command == "train" else ""  # the preference starters name their sample pairs
    print(f"next: reinforge {command} {config.as_posix()} model.path=...{data} (see the file's comments)")
    return 0
