"""Reading dataset rows from disk: parquet, JSONL (or a JSON list), and ``datasets`` folders.

Every reader returns plain Python rows (dicts of str, int, float, list, dict, None), never
numpy arrays, so that a row looks the same whichever format it came from and pickles cheaply.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Row = dict[str, Any]


GLOB_CHARACTERS = "*?["


def expand_data_files(files: Iterable[str | Path], key: str) -> list[str | Path]:
    """``files`` with each glob pattern (``data/*.parquet``) replaced by the files it matches, sorted; a path that
    exists as written is taken as it is, and a pattern that matches nothing is one line naming ``key``."""
    expanded: list[str | Path] = []
    for entry in files:
        text = str(entry)
        if Path(text).expanduser().exists() or not any(character in text for character in GLOB_CHARACTERS):
            expanded.append(entry)
            continue
        matches = sorted(glob.glob(str(Path(text).expanduser()), recursive=True))
        if not matches:
            raise FileNotFoundError(f"{key} pattern {text!r} matches no file (looked in {Path.cwd()}); check {key}")
        expanded.extend(matches)
    return expanded


def read_rows(path: str | Path) -> list[Row]:
    """All rows of one parquet file, JSONL file, JSON file holding a list (or one object per line, as
    ``datasets``' ``to_json`` writes it), or ``save_to_disk`` folder."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist (looked in {path.resolve()}); "
                                "check data.train_files / data.val_files")
    if path.is_dir():
        return _read_datasets_folder(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path)
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path)
    raise ValueError(f"cannot read {str(path)!r}: expected a .parquet, .jsonl or .json file, "
                     "or a folder written by datasets.Dataset.save_to_disk")


def as_list(value: Any) -> Any:
    """A list column of a parquet row (read as an array) as a list; any other value as it is."""
    return list(value) if hasattr(value, "tolist") and not isinstance(value, str) else value


def _read_parquet(path: Path) -> list[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{path} is not a readable parquet file ({type(error).__name__}: "
                         f"{' '.join(str(error).split())}); write it again, e.g. with pandas' to_parquet") from None
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"{path} has more than one column named {', '.join(map(repr, repeated))}; a row could not "
                         "say which one it means: write the file with each column once")
    return pq.read_table(path).to_pylist()


def _decoded(raw: bytes, path: Path, line_number: int) -> str:
    try:
        return raw.decode("utf-8-sig" if line_number == 1 else "utf-8")  # a byte-order mark some editors write
    except UnicodeDecodeError as error:
        raise ValueError(f"line {line_number} of {path} has a byte that is not UTF-8 (0x{raw[error.start]:02x} at "
                         f"byte {error.start + 1} of the line); save the file as UTF-8") from None


class _RepeatedKey(ValueError):
    """A JSON object that gives one key twice (json keeps the last silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for key, value in pairs:
        if key in row:
            raise _RepeatedKey(key)
        row[key] = value
    return row


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    with path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            line = _decoded(raw, path, line_number)
            if not line.strip():
                continue
            try:
                row = json.loads(line, object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as error:
                raise ValueError(f"line {line_number} of {path} is not valid JSON ({error.msg} at column "
                                 f"{error.colno}); each line of a .jsonl file holds one JSON object") from None
            except _RepeatedKey as error:
                raise ValueError(f"line {line_number} of {path} gives the key {error.args[0]!r} twice in one object; "
                                 "keep one of them") from None
            if not isinstance(row, dict):
                raise ValueError(f"line {line_number} of {path} holds a {type(row).__name__}, not a JSON object; "
                                 "each line of a .jsonl file holds one row as an object")
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[Row]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark some editors write
    except UnicodeDecodeError as error:
        body = error.object  # the bytes after a byte-order mark, which error.start counts in
        line_start = body.rfind(b"\n", 0, error.start) + 1
        line_end = body.find(b"\n", error.start)
        line = body[line_start:line_end if line_end >= 0 else len(body)]
        _decoded(line, path, body.count(b"\n", 0, error.start) + 1)  # raises, naming the line
        raise
    try:
        content = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data" and text.lstrip().startswith("{"):
            return _read_jsonl(path)  # one object per line, as datasets' to_json writes a .json file
        raise ValueError(f"{path} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}); "
                         "it must hold a JSON list of row objects, or one row object per line") from None
    except _RepeatedKey as error:
        raise ValueError(f"{path} gives the key {error.args[0]!r} twice in one object; keep one of them") from None
    if not isinstance(content, list) or not all(isinstance(row, dict) for row in content):
        raise ValueError(f"{path} must hold a JSON list of row objects; for one object per line use .jsonl")
    return content


DATA_SUFFIXES = (".parquet", ".jsonl", ".ndjson", ".json")
"""The files read_rows reads."""


def _read_datasets_folder(path: Path) -> list[Row]:
    if not any((path / name).is_file() for name in ("state.json", "dataset_dict.json")):  # not a save_to_disk folder
        suffixes = sorted({entry.suffix.lower() for entry in path.iterdir() if entry.suffix.lower() in DATA_SUFFIXES})
        fix = (f"name its files instead, e.g. {path / ('*' + suffixes[0])}" if suffixes else
               "name a .parquet, .jsonl or .json file instead")
        raise ValueError(f"data file {str(path)!r} is a folder that datasets.Dataset.save_to_disk did not write; {fix} "
                         "(check data.train_files / data.val_files)")
    try:
        import datasets
    except ImportError:
        raise ImportError(f"reading the folder {path} needs the 'datasets' package; "
                          "pip install 'reinforge[data]'") from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(str(path / split) for split in loaded)
        raise ValueError(f"{path} holds several splits ({', '.join(loaded)}); point the config at one of them: {splits}")
    return loaded.to_list()
