"""The README's commands run as written: through the venv that `make` builds, or a make target that exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def readme_commands() -> list[str]:
    """Every shell line of the README's bash blocks and every inline `python ...`, `reinforge ...` or `make ...`."""
    lines = [line.strip() for block in re.findall(r"```bash\n(.*?)```", README, re.DOTALL)
             for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]
    inline = re.findall(r"`((?:[A-Z_]+=\S+ )*(?:python3?|\S*reinforge|make) [^`]*)`", README)
    return lines + inline


def test_every_readme_command_uses_the_venv_or_a_make_target():
    commands = readme_commands()
    assert any(command.startswith("make bench") for command in commands)  # the speed section's command
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.MULTILINE))
    for command in commands:
        if command.startswith("make "):
            assert command.split()[1] in targets, f"README runs {command!r}, which the Makefile lacks"
        elif re.match(r"(?:[A-Z_]+=\S+ )*python3? ", command):
            raise AssertionError(f"README runs {command!r} with the system python; use .venv/bin/python (or make)")
