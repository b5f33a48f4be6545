"""``reinforge config from-verl`` and ``reinforge train --from-verl``: run a verl command line here.

    reinforge config from-verl data.train_files=~/data/gsm8k/train.parquet actor_rollout_ref.rollout.n=5 ... -o run.yaml
    reinforge train --from-verl python3 -m verl.trainer.main_ppo data.train_files=... -- rollout.name=hf

Both print the mapping (each verl key, what it became or why it has none) on stderr. The first
writes our YAML (only what differs from our defaults) to ``-o`` or stdout; the second trains,
with our own ``a.b=c`` overrides after ``--``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from reinforge.config.loader import ConfigError, load_config
from reinforge.config.schema import Config
from reinforge.config.verl.translate import VerlTranslation, check_samples_per_prompt, translate_verl

USAGE = ("usage: reinforge config from-verl [python3 -m MODULE] VERL_KEY=VALUE ... [-o out.yaml]\n\n"
         "Translates a verl command line (the words after python3 -m verl.trainer.main_ppo, or the whole command\n"
         "with verl's one-step-off or fully async trainer as MODULE) into a reinforge YAML config, printing what\n"
         "each verl key became and why the others have no equivalent.")
TRAIN_USAGE = ("usage: reinforge train --from-verl [python3 -m MODULE] VERL_KEY=VALUE ... [-- a.b=c ...]\n\n"
               "Trains with a verl command line (the words after python3 -m verl.trainer.main_ppo, or the whole\n"
               "command with verl's one-step-off or fully async trainer as MODULE), translated as reinforge config\n"
               "from-verl prints it; reinforge's own a.b=c overrides go after --.")
HELP_FLAGS = ("-h", "--help")


def asks_for_help(arguments: list[str]) -> bool:
    """-h or --help among verl's words (before any --): they are not key=value overrides."""
    return any(argument in HELP_FLAGS for argument in _split_at_double_dash(arguments)[0])


def _split_at_double_dash(arguments: list[str]) -> tuple[list[str], list[str]]:
    """verl's words and ours, at the first ``--`` after the module a pasted command runs: one before ``-m``
    belongs to its launcher (``ray job submit --address=... -- python3 -m verl.trainer.main_ppo ...``)."""
    start = arguments.index("-m") if "-m" in arguments else 0
    if "--" in arguments[start:]:
        position = arguments.index("--", start)
        return arguments[:position], arguments[position + 1:]
    return arguments, []


def _report(translation: VerlTranslation) -> None:
    print(translation.report(), file=sys.stderr)


def load_from_verl(arguments: list[str], missing_package: Callable[[str], str | None] | None = None,
                   needs_groups: Callable[[str], bool] | None = None) -> Config:
    """``VERL_KEY=VALUE ... [-- our.key=value ...]``: the translated, validated config; prints the mapping.

    ``missing_package(logger)``: the package a logger lacks on this machine (``tracking.missing_backend_package``);
    such a logger of the verl command is left out with one warning line, as the command was written for
    another machine and the run folder's metrics.jsonl keeps every metric anyway. ``needs_groups(estimator)``:
    whether an advantage estimator compares a prompt's samples (the registry's), for a refusal of one sample a
    prompt in verl's terms.
    """
    verl_arguments, overrides = _split_at_double_dash(arguments)
    if not verl_arguments:
        raise ConfigError("--from-verl needs verl's key=value overrides, e.g. reinforge train --from-verl "
                          "data.train_files=/data/train.parquet actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B")
    translation = translate_verl(verl_arguments)
    _report(translation)
    if missing_package is not None:
        _drop_loggers_not_installed(translation, missing_package)
    config = load_config(None, overrides, tree=translation.tree)
    if needs_groups is not None and not any(override.startswith("rollout.n=") for override in overrides):
        check_samples_per_prompt(translation, config, needs_groups)
    return config


def _drop_loggers_not_installed(translation: VerlTranslation, missing_package: Callable[[str], str | None]) -> None:
    trainer = translation.tree.get("trainer", {})
    for name in list(trainer.get("loggers", [])):
        package = missing_package(name)
        if package is not None:
            trainer["loggers"].remove(name)
            others = "".join(f"{other}, " for other in trainer["loggers"] if other != "jsonl")
            print(f"warning: trainer.logger names {name}, whose package {package} is not installed here; logging to "
                  f"{others}metrics.jsonl without it (pip install {package} to log there)", file=sys.stderr)


def config_main(argv: list[str], check: Callable[[Config], None],
                needs_groups: Callable[[str], bool] | None = None) -> int:
    """``check``: every rule of a config (``trainer.preflight.check_config``, which names registries above config);
    ``needs_groups``: as ``load_from_verl``'s."""
    if not argv or argv[0] in HELP_FLAGS or (argv[0] == "from-verl" and asks_for_help(argv[1:])):
        print(USAGE)
        return 0
    if argv[0] != "from-verl":
        print(f"unknown config command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    arguments, output = list(argv[1:]), None
    for flag in ("-o", "--output"):
        if flag in arguments:
            position = arguments.index(flag)
            if position + 1 >= len(arguments):
                raise ConfigError(f"{flag} (command line) needs a file name, e.g. {flag} run.yaml")
            output = Path(arguments[position + 1])
            del arguments[position:position + 2]
    if output is not None and output.is_dir():
        raise ConfigError(f"-o {output} (command line) is a folder; name the YAML file to write, e.g. "
                          f"-o {output / 'run.yaml'}")
    if not arguments:
        raise ConfigError("reinforge config from-verl needs verl's key=value overrides, "
                          "e.g. data.train_files=/data/train.parquet actor_rollout_ref.rollout.n=5")
    translation = translate_verl(arguments)
    _report(translation)
    config = load_config(None, tree=translation.tree)
    if needs_groups is not None:
        check_samples_per_prompt(translation, config, needs_groups)
    check(config)  # the translation must load and pass every rule
    if output is None:
        print(translation.to_yaml(), end="")
    else:
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(translation.to_yaml())
        except OSError as error:  # a parent that is a file, a folder not writable
            blocker = next((parent for parent in output.parents if parent.exists()), None)
            reason = f"{blocker} is a file" if blocker is not None and not blocker.is_dir() else error.strerror or error
            raise ConfigError(f"-o {output} (command line) cannot be written: {reason}; choose another file") from error
        print(f"wrote {output}; run it with: reinforge train {output}", file=sys.stderr)
    return 0
