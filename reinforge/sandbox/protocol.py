"""SandboxFusion's ``POST /run_code`` contract as dataclasses: the request we accept, the answer we give.

The field names and status words are SandboxFusion's (bytedance/SandboxFusion,
``sandbox/server/sandbox_api.py``), so one client talks to our server and to a real
deployment. The response status follows its rules: a run the sandbox could not carry out is
``SandboxError``; a timeout or a non-zero exit is ``Failed``; anything else ``Success``.
Departures: only ``python`` and ``bash`` run here, ``files`` must be relative paths inside
the sandbox's working folder (SandboxFusion joins an absolute path onto its host), and
``fetch_files`` must be empty.
"""

from __future__ import annotations

import base64
import binascii
import math
import posixpath
from dataclasses import asdict, dataclass, field
from typing import Any

LANGUAGES = ("python", "bash")
SUCCESS, FAILED, SANDBOX_ERROR = "Success", "Failed", "SandboxError"
FINISHED, ERROR, TIME_LIMIT_EXCEEDED = "Finished", "Error", "TimeLimitExceeded"
MAX_FILES = 64
MAX_NAME_BYTES, MAX_PATH_BYTES = 255, 4000
MIN_MEMORY_MB = 32
"""The least ``memory_limit_MB`` a program may ask for. python3 (3.11) starts under this sandbox's limits from
13-14 MB of address space, bash from 4; below that the dynamic loader, or Python's start-up, fails with a
message that does not say the limit is why (``libc.so.6: failed to map segment``). 32 leaves room for other
interpreters and a few imports."""


class RequestError(ValueError):
    """A ``/run_code`` body that cannot run as sent; the server answers 400 with this message."""


def _number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{key}={value!r} is not a number; send seconds or megabytes as a JSON number")
    try:  # a JSON integer has no size limit: 1 followed by 400 zeros is an int that no float holds
        number = float(value)
    except OverflowError:
        raise RequestError(f"{key}={str(value)[:20]}... is too large a number; send seconds or megabytes as a "
                           "JSON number") from None
    if not math.isfinite(number):
        raise RequestError(f"{key}={value!r} is not a finite number; send seconds or megabytes as a JSON number")
    return number


def _check_text(key: str, text: str) -> None:
    """A JSON string may hold a lone surrogate (\\ud800), which no file can: a 400, not a failed run."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(f"{key} holds {text[error.start:error.end]!r} at position {error.start}, which is not "
                           "a character; send UTF-8 text") from None


def _check_file_path(path: Any) -> str:
    if not isinstance(path, str) or not path:
        raise RequestError(f"files key {path!r} is not a file path; use a relative path such as 'data/input.txt'")
    _check_text("a files key", path)
    normalized = posixpath.normpath(path)
    if path.startswith("/") or normalized == "." or normalized.startswith("..") or "\x00" in path:
        raise RequestError(f"files key {path!r} leaves the working folder; use a relative path without '..'")
    # the file system's limits (NAME_MAX, PATH_MAX): past them bwrap fails and the answer was a SandboxError
    if any(len(part.encode()) > MAX_NAME_BYTES for part in normalized.split("/")) or len(
            normalized.encode()) > MAX_PATH_BYTES:
        raise RequestError(f"files key {path[:60]!r}... is too long; use names of at most {MAX_NAME_BYTES} bytes "
                           f"and paths of at most {MAX_PATH_BYTES}")
    return normalized


@dataclass
class RunCodeRequest:
    """One program to run, with its inputs; ``files`` maps a relative path to base64 content."""

    code: str
    language: str = "python"
    compile_timeout: float = 10.0
    run_timeout: float = 10.0
    memory_limit_MB: int = -1
    stdin: str | None = None
    files: dict[str, str | None] = field(default_factory=dict)
    fetch_files: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, body: Any) -> RunCodeRequest:
        """Validate a decoded JSON body; unknown keys are ignored, as SandboxFusion does."""
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object with at least 'code' and 'language'")
        code, language = body.get("code"), body.get("language")
        if not isinstance(code, str):
            raise RequestError("'code' is missing or not a string")
        if language not in LANGUAGES:
            raise RequestError(f"language={language!r} is not supported here; use one of {', '.join(LANGUAGES)}")
        stdin = body.get("stdin")
        if stdin is not None and not isinstance(stdin, str):
            raise RequestError("'stdin' must be a string or null")
        _check_text("'code'", code)
        _check_text("'stdin'", stdin or "")
        files = body.get("files") or {}
        if not isinstance(files, dict) or len(files) > MAX_FILES:
            raise RequestError(f"'files' must be an object of at most {MAX_FILES} path -> base64 entries")
        normalized = set()
        for path, content in files.items():
            normalized.add(_check_file_path(path))
            if content is not None and not isinstance(content, str):
                raise RequestError(f"files[{path!r}] must be a base64 string or null")
        for path in normalized:
            folder = posixpath.dirname(path)
            while folder:
                if folder in normalized:
                    raise RequestError(f"files key {folder!r} is a file and also the folder of {path!r}; "
                                       "rename one of them")
                folder = posixpath.dirname(folder)
        if body.get("fetch_files"):
            raise RequestError("fetch_files is not supported by the reinforge sandbox; print what you need instead")
        memory_limit_mb = int(_number(body, "memory_limit_MB", -1))
        if 0 < memory_limit_mb < MIN_MEMORY_MB:
            raise RequestError(f"memory_limit_MB={memory_limit_mb} is too little for a program to start (python3 "
                               f"needs about 14 MB); send at least {MIN_MEMORY_MB}, or -1 for the server's default")
        return cls(code=code, language=language, compile_timeout=_number(body, "compile_timeout", 10.0),
                   run_timeout=_number(body, "run_timeout", 10.0), memory_limit_MB=memory_limit_mb, stdin=stdin,
                   files=dict(files))

    def decoded_files(self) -> dict[str, bytes]:
        """Normalized relative path -> bytes, for the files that have content."""
        decoded = {}
        for path, content in self.files.items():
            if content is None:
                continue
            try:
                # line breaks and spaces are allowed (`base64` wraps at 76 columns); anything else outside the alphabet is not
                decoded[_check_file_path(path)] = base64.b64decode("".join(content.split()), validate=True)
            except binascii.Error:
                raise RequestError(f"files[{path!r}] is not valid base64") from None
        return decoded

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CommandRunResult:
    """How one command ended: ``status`` is Finished, Error (the sandbox failed) or TimeLimitExceeded."""

    status: str
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any] | None) -> CommandRunResult | None:
        if body is None:
            return None
        return cls(status=str(body.get("status")), execution_time=body.get("execution_time"),
                   return_code=body.get("return_code"), stdout=body.get("stdout"), stderr=body.get("stderr"))


@dataclass
class RunCodeResponse:
    """The answer to ``/run_code``; ``status`` is Success, Failed or SandboxError."""

    status: str
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    files: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_run(cls, run_result: CommandRunResult) -> RunCodeResponse:
        """SandboxFusion's rule: Error -> SandboxError (message: stderr), timeout or exit != 0 -> Failed."""
        if run_result.status == ERROR:
            return cls(status=SANDBOX_ERROR, message=run_result.stderr or "", run_result=run_result)
        failed = run_result.status == TIME_LIMIT_EXCEEDED or run_result.return_code not in (0, None)
        return cls(status=FAILED if failed else SUCCESS, run_result=run_result)

    @classmethod
    def from_json(cls, body: Any) -> RunCodeResponse:
        """Read a response from our server or a SandboxFusion deployment (extra keys are ignored)."""
        if not isinstance(body, dict) or "status" not in body:
            raise ValueError(f"not a /run_code response: {str(body)[:200]!r}")
        return cls(status=str(body["status"]), message=str(body.get("message") or ""),
                   compile_result=CommandRunResult.from_json(body.get("compile_result")),
                   run_result=CommandRunResult.from_json(body.get("run_result")), files=dict(body.get("files") or {}))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
