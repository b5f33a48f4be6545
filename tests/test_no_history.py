"""The repository speaks of what reinforge does, never of how it was built.

Every tracked text file is searched for phrases that narrate the project's development (which
session or round of work, issue numbers, "this call", "before the fix", work tags like ``s13b``,
commit hashes in prose) and the test names each hit as ``file:line``. The patterns are narrow on
purpose: a session-scoped fixture, a process's own session, a Ray session or a tool call are
descriptions of the code and pass.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
             "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\\d+(?:st|nd|rd|th)")

PATTERNS: dict[str, tuple[tuple[str, ...], re.Pattern[str]]] = {
    "an ordinal session or round of work": (("session", "round", "device call", "helper"), re.compile(
        rf"\b(?:{_ORDINALS})(?:'s)?\s+(?:session|round of work|device call|helper)s?\b")),
    "a session or round of work in time": (("session", "round"), re.compile(
        r"\b(?:previous|earlier|later|last|next)\s+(?:session|round of work)s?\b|\bsessions? of work\b"
        r"|\brounds? of work\b")),
    "an issue number": (("issue", "#"), re.compile(r"\bissues?\s+#?\d{1,3}\b|(?<![\w/&#])#\d{1,2}\b(?!\s*[-:=])")),
    "a work tag (s13, s13b)": (("s1",), re.compile(r"(?<![\w.\-/])s1\d[a-z]?\b")),
    "'this call' (a device call of a benchmark)": (("this",), re.compile(r"\bthis (?:device |gpu )?call\b")),
    "a fix in time": (("fix", "commit"), re.compile(
        r"\b(?:before|after|since|until) (?:the|this|that) (?:fix|commit)\b|\bsince commit\b")),
    "an earlier version": (("version",), re.compile(r"\b(?:earlier|older|former) versions?\b")),
    "'used to' (what the code once did)": (("used to",), re.compile(
        r"\b(?:it|they|we|which|that|this|one|each)\s+used to\b"
        r"|\bused to (?:be|slip|drop|abort|carry|fail|raise|plan|count|ignore|run|take|give|report|read)\b")),
    "a commit hash in prose": (("commit", "("), re.compile(r"\bcommits?\s+[0-9a-f]{7,40}\b|\([0-9a-f]{7}\)")),
}
"""What narrates development history, by name: the words a line must hold (lowercased) before its pattern is tried,
and the pattern, matched against the lowercased line."""

ALLOWED: dict[str, tuple[str, ...]] = {
    # the benchmark tables, and the analyses of them, name the commit each figure was measured at
    "a commit hash in prose": ("BENCHMARKS.md", "docs/performance.md"),
}
"""Files where a pattern describes the repository's contents rather than its history."""

SKIPPED = {"tests/test_no_history.py"}


def tracked_text_files() -> list[Path]:
    """The repository's tracked files (git ls-files) that read as UTF-8 text, this test's own file aside."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    files = []
    for name in listed.decode().split("\0"):
        path = ROOT / name
        if not name or name in SKIPPED or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def history_mentions(text: str, name: str) -> list[str]:
    """``name:line: what (the line)`` for each line of ``text`` that narrates development history."""
    checks = [(what, words, pattern) for what, (words, pattern) in PATTERNS.items() if name not in ALLOWED.get(what, ())]
    found = []
    for number, line in enumerate(text.lower().splitlines(), 1):
        for what, words, pattern in checks:
            if any(word in line for word in words) and (match := pattern.search(line)):
                found.append(f"{name}:{number}: {what}: {match.group(0)!r} in {line.strip()[:120]!r}")
    return found


def test_no_file_narrates_how_the_project_was_built():
    files = tracked_text_files()
    assert files, "git ls-files listed no text file"
    mentions = [hit for path in files
                for hit in history_mentions(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())]
    assert not mentions, "development history in the repository (say what the code does instead):\n" + "\n".join(mentions)


@pytest.mark.parametrize("line", [
    "measured in the thirteenth session", "the eighth session's plan", "PART=s13b OUT=x", "see s13 above",
    "the speed targets of issue 14", "fixed in #17", "in this call the table", "before the fix it failed",
    "Earlier versions drew other samples", "a micro-batch used to drop kv_index", "they used to be ignored",
    "since the fix the layers", "since commit f0b0fdc the layers", "the planner (commit 4d02f25) chooses", "the 9th session",
])
def test_history_is_found(line):
    assert history_mentions(line, "x.md")


@pytest.mark.parametrize("line", [
    '@pytest.fixture(scope="session")', "built once per session", "its own session, and death with its parent",
    "the session's Ray instance", '"--new-session", "--as-pid-1"', "a second call does nothing",
    "at its first call (decorators' frames too)", "the rewards of a trajectory's calls", "verl's silent fallback (#2966)",
    "in round 2, sequence 1 has as many blocks", "the seed used to sample the noise", "x.s13 = 1",
    "the same prefix, before the change, is reused", "sha256 0123abcd4567ef", "run 1/4 of the rows",
])
def test_descriptions_of_the_code_pass(line):
    assert not history_mentions(line, "x.md")
