"""Translate a verl command line (``python3 -m verl.trainer.main_ppo a.b=c ...``) into our config.

``translate_verl(arguments)`` reads verl's Hydra overrides (``data.train_files=/x.parquet``,
``trainer.logger='["console","wandb"]'``, ``+custom_reward_function.reward_kwargs.k=v``), looks
each key up in ``keys.VERL_KEYS`` and returns our config as a nested tree of the keys that
differ from our defaults, with one report line per verl key: what it became, or why it has no
equivalent. A verl default that differs from ours in a way that changes the run (GAE, 1024
prompts a step, one sample per prompt, ...) is carried over when the command leaves the key out,
so the translated run computes what the verl command would. A key verl does not have fails with
the closest one it does have.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from reinforge.config.errors import ConfigError
from reinforge.config.schema import Config
from reinforge.config.verl.config_names import config_file_settings
from reinforge.config.verl.entry_points import (
    ENTRY_POINTS,
    FULLY_ASYNC,
    SFT_MODULES,
    entry_point,
    entry_points_with,
    prompts_per_update,
)
from reinforge.config.verl.keys import (
    UNSET,
    VERL_KEYS,
    VERL_SECTIONS,
    NoEquivalent,
    NoEquivalentValue,
    Refused,
    RefusedValue,
    Rename,
    SameAsOurs,
    Translation,
    implied_settings,
    lookup,
    our_key,
)

LAUNCHER_WORDS = ("python", "python3")
"""Words of verl's launch command that may be pasted along with its overrides, without ``-m``; they are skipped."""

HYDRA_OPTIONS = ("--config-path", "--config-dir", "--config-name", "-cp", "-cd", "-cn")
"""Hydra's options for picking verl's config file; the file's keys are the ones translated."""

@dataclass(frozen=True)
class KeyLine:
    """What one verl key became."""

    verl_key: str
    verl_value: Any
    our_key: str | None = None
    our_value: Any = None
    reason: str = ""
    """Why there is nothing to set: no equivalent, or reinforge already behaves so."""
    from_verl_default: bool = False
    implied: bool = False
    """Set by no single verl key: ``verl_key`` then says why."""
    our_default: bool = False
    """The translated value is our default too, so the YAML leaves it out."""
    note: str = ""

    def render(self) -> str:
        if self.implied:
            return f"  ({self.verl_key})  ->  {self.our_key}={_show(self.our_value)}"
        given = f"{self.verl_key}={_show(self.verl_value)}"
        if self.from_verl_default:
            given = f"{given} (verl's default)"
        if self.our_key is not None:
            notes = [*(["our default too"] if self.our_default else []), *([self.note] if self.note else [])]
            note = f" ({'; '.join(notes)})" if notes else ""
            return f"  {given}  ->  {self.our_key}={_show(self.our_value)}{note}"
        return f"  {given}: {self.reason}"


@dataclass
class VerlTranslation:
    tree: dict[str, Any] = field(default_factory=dict)
    """Our config as nested sections, only the keys the verl command changes."""
    translated: list[KeyLine] = field(default_factory=list)
    already_ours: list[KeyLine] = field(default_factory=list)
    no_equivalent: list[KeyLine] = field(default_factory=list)

    def report(self) -> str:
        """The mapping, for a person: one line per verl key, grouped by what happened to it."""
        parts = []
        for title, lines in (("translated", self.translated),
                             ("nothing to set (reinforge already does this)", self.already_ours),
                             ("no equivalent in reinforge (left out)", self.no_equivalent)):
            if lines:
                parts.append(f"{title}:\n" + "\n".join(line.render() for line in lines))
        return "\n".join(parts)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.tree, sort_keys=False)


def _show(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def split_entry_point(arguments: Iterable[str]) -> tuple[str | None, list[str]]:
    """The module a pasted launch command runs (``python3 -m MODULE``, ``torchrun ... -m MODULE``, or the module
    alone) and the words after it; None and every word when the command is only verl's key=value words."""
    words = list(arguments)
    if "-m" in words:
        at = words.index("-m")
        if at + 1 == len(words):
            raise ConfigError("-m (verl command line) needs the module it runs, e.g. -m verl.trainer.main_ppo")
        misplaced = next((word for word in words[:at] if _VERL_KEY_WORD.match(word)), None)
        if misplaced is not None:
            raise ConfigError(f"{misplaced} (verl command line) comes before -m {words[at + 1]}; verl's key=value "
                              "words go after the module")
        return words[at + 1], words[at + 2:]
    first = next((index for index, word in enumerate(words) if word.strip() and word not in LAUNCHER_WORDS), None)
    if first is not None and (words[first] in ENTRY_POINTS or words[first] in SFT_MODULES):
        return words[first], words[first + 1:]
    return None, words


_VERL_KEY_WORD = re.compile(r"^\+?[a-z_]+\.[\w.]+=")
"""A verl key=value word (a launcher's own options start with -, environment settings are upper case)."""


def _keys_of(module: str | None) -> dict[str, Translation]:
    """verl's keys as the entry point ``module`` reads them: its own config's over the PPO trainer's."""
    return {**VERL_KEYS, **entry_point(module).keys}


def parse_verl_overrides(arguments: Iterable[str]) -> dict[str, Any]:
    """verl's ``key=value`` words (after the launch command, if pasted) as a flat dict of dotted keys, in order; values
    parsed as YAML like Hydra's."""
    module, arguments = split_entry_point(arguments)
    table = _keys_of(module)
    given: dict[str, Any] = {}
    from_config_file: dict[str, Any] = {}
    words = iter(arguments)
    for word in words:
        if word in LAUNCHER_WORDS or not word.strip():  # a stray `\ ` in a shell script passes " "
            continue
        if word.split("=", 1)[0] in HYDRA_OPTIONS:
            option, _, value = word.partition("=")
            value = value if "=" in word else next(words, "")
            if option in ("--config-name", "-cn"):
                from_config_file = config_file_settings(option, value)
            continue
        if word.lstrip("+").startswith("hydra.searchpath") or "@" in word.split("=", 1)[0]:
            raise ConfigError(f"{word} (verl command line) makes Hydra read another config file (a package's own "
                              "engine, as Megatron Lite's), which reinforge cannot translate; leave it out with the "
                              "keys that file defines, or translate the command as verl's own engines run it")
        if word.startswith("~"):
            raise ConfigError(f"{word!r} (verl command line) deletes a key, which has no meaning here; leave it out")
        if "=" not in word:
            raise ConfigError(f"{word!r} (verl command line) is not of the form key=value, e.g. "
                              "actor_rollout_ref.rollout.n=5")
        key, raw = word.split("=", 1)
        key = key.strip().lstrip("+")
        if not raw.strip() and _sets_a_value(key, table):
            raise ConfigError(f"{word.strip()} (verl command line) has no value, as `{key}=$VAR` gives when the shell "
                              "variable VAR is not set; set VAR or write the value, or leave the key out")
        if _has_top_level_comma(raw):
            raise ConfigError(f"{word.strip()} (verl command line) is Hydra's sweep over several values, which verl "
                              f"refuses without --multirun; for a list write {key}=[{raw.strip()}], for one string "
                              f"quote it: {key}=\"'{raw.strip()}'\"")
        _add(given, key, _parse_value(raw))
    return {**from_config_file, **given}  # the command's own keys win over its config file's, as in Hydra


def _has_top_level_comma(raw: str) -> bool:
    """A comma outside quotes, brackets and ${...}: Hydra reads ``a,b`` as a sweep, not as one value."""
    depth, quote = 0, ""
    for char in raw:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            return True
    return False


def _sets_a_value(verl_key: str, table: Mapping[str, Translation]) -> bool:
    """True for a verl key whose value becomes one of our settings (or is checked against what reinforge does)."""
    found = lookup(verl_key, table)
    return found is not None and isinstance(found[1], (Rename, Refused))


class _HydraValueLoader(yaml.SafeLoader):
    """YAML with Hydra's override grammar for unquoted scalars: true/false/null in any case, decimal ints
    (1_000), floats with or without a dot (1e-6, inf, nan); anything else (yes, on, 010, 0x10, 12:30,
    2024-01-01) is a string, where YAML 1.1 would read a bool, an octal, a sexagesimal or a date."""


_HydraValueLoader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in (
        ("tag:yaml.org,2002:bool", r"^(?:[Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee])$", "tTfF"),
        ("tag:yaml.org,2002:null", r"^[Nn][Uu][Ll][Ll]$", "nN"),
        ("tag:yaml.org,2002:int", r"^[-+]?(?:0|[1-9](?:_?[0-9])*)$", "-+0123456789"),
        ("tag:yaml.org,2002:float", r"^[-+]?(?:(?:(?:0|[1-9](?:_?[0-9])*)?\.[0-9](?:_?[0-9])*|(?:0|[1-9](?:_?[0-9])*)\.)"
                                    r"(?:[eE][-+]?[0-9](?:_?[0-9])*)?|(?:0|[1-9](?:_?[0-9])*)[eE][-+]?[0-9](?:_?[0-9])*"
                                    r"|[Ii][Nn][Ff]|[Nn][Aa][Nn])$", "-+0123456789.iInN")):
    _HydraValueLoader.add_implicit_resolver(_tag, re.compile(_pattern), list(_first))


def _parse_value(raw: str) -> Any:
    """A value as Hydra reads it: YAML flow syntax (lists, dicts, quotes) with Hydra's scalars (``_HydraValueLoader``);
    a quoted value stays a string."""
    if not raw.strip():
        return ""
    try:
        return yaml.load(_spaced_dict_keys(raw), Loader=_HydraValueLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError:
        return raw


def _spaced_dict_keys(raw: str) -> str:
    """Hydra's dicts take ``{key:value}`` with no space after the colon, where YAML would read one key
    ``key:value``: a space after each key's colon of a ``{...}`` outside quotes (an interpolation's ``${...}`` kept
    as it is)."""
    if "{" not in raw:
        return raw
    out: list[str] = []
    brackets: list[str] = []
    quote = ""
    key_part = False  # between a dict's "{" or "," and its key's colon
    for index, char in enumerate(raw):
        out.append(char)
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "{[":
            interpolation = char == "{" and index > 0 and raw[index - 1] == "$"
            brackets.append("$" if interpolation else char)
            key_part = char == "{" and not interpolation
        elif char in "}]":
            if brackets:
                brackets.pop()
            key_part = False
        elif char == "," and brackets:
            key_part = brackets[-1] == "{"
        elif char == ":" and key_part:
            key_part = False
            if index + 1 < len(raw) and not raw[index + 1].isspace():
                out.append(" ")
    return "".join(out)


def _add(given: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key``; a mapping value under a section of many keys is spread over them (a.b={c: 1} is a.b.c=1)."""
    if isinstance(value, Mapping) and value and (key not in VERL_KEYS or f"{key}.*" in VERL_KEYS):
        for inner, item in value.items():
            _add(given, f"{key}.{inner}", item)
    else:
        given[key] = value


def _default_of(dotted: str) -> Any:
    node: Any = Config()
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(node) or not hasattr(node, part):
            return UNSET
        node = getattr(node, part)
    return node


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _unknown_key(key: str) -> ConfigError:
    modules = entry_points_with(key)
    if modules:
        return ConfigError(f"{key} (verl command line) is a key of {' and '.join(modules)}, not of verl's PPO "
                           f"trainer; paste the command with its module: --from-verl python3 -m {modules[0]} ...")
    exact = [name for name in VERL_KEYS if not name.endswith(".*")]
    parts = key.split(".")
    above = next((".".join([*parts[:length], parts[-1]]) for length in range(len(parts) - 2, -1, -1)
                  if ".".join([*parts[:length], parts[-1]]) in exact), None)
    if above is not None:  # verl's SAPO examples pass +actor_rollout_ref.actor.policy_loss.tau_pos, verl reads actor's
        return ConfigError(f"{key} (verl command line) is not a verl key (verl's config has no such field either); "
                           f"the setting is verl's {above}: pass {above}=... instead")
    close = difflib.get_close_matches(key, exact, n=1, cutoff=0.6)
    ours = _our_name_for(key)
    if ours is not None:  # one of reinforge's settings written into verl's section (+actor_rollout_ref.actor.router_...)
        leaf = key.rsplit(".", 1)[-1]
        similar = [name for name in close if difflib.SequenceMatcher(None, leaf, name.rsplit(".", 1)[-1]).ratio() > 0.8]
        return ConfigError(f"{key} (verl command line) is not a verl key; reinforge's own {ours} has this name: pass "
                           f"{ours}=... after -- (reinforge train --from-verl ... -- {ours}=...)"
                           + (f"; or did you mean verl's {similar[0]}?" if similar else ""))
    hint = f"; did you mean {close[0]}?" if close else "; check the key against verl's ppo_trainer.yaml"
    if key.split(".")[0] not in VERL_SECTIONS:
        return ConfigError(f"{key} (verl command line) is not a key of verl's PPO trainer{hint}")
    return ConfigError(f"{key} (verl command line) is not a verl key reinforge knows{hint}")


def _our_name_for(verl_key: str) -> str | None:
    """Our key for a key under one of verl's sections that our schema has by the same name (actor.*, rollout.*)."""
    for ours, theirs in OUR_SECTIONS_IN_VERL.items():
        if verl_key.startswith(f"{theirs}."):
            candidate = f"{ours}.{verl_key[len(theirs) + 1:]}"
            default = _default_of(candidate)
            return candidate if default is not UNSET and not dataclasses.is_dataclass(default) else None
    return None


def translate_verl(arguments: Iterable[str] | Mapping[str, Any], module: str | None = None) -> VerlTranslation:
    """Our config tree and the per-key report for a verl command line (or an already parsed flat dict of the keys
    of ``module``'s config); the command's ``python3 -m MODULE``, if pasted, picks the entry point."""
    if isinstance(arguments, Mapping):
        given = dict(arguments)
    else:
        module, words = split_entry_point(arguments)
        given = parse_verl_overrides(words)
    point, table = entry_point(module), _keys_of(module)
    context = dict(given)  # what the conversions read: a fully async step's prompts are its data.train_batch_size
    if point is FULLY_ASYNC:
        context["data.train_batch_size"] = prompts_per_update(given)
    result = VerlTranslation()
    sources: dict[str, tuple[str, Any]] = {}
    if point.mode != _default_of("trainer.mode"):
        _set(result.tree, "trainer.mode", point.mode)
        sources["trainer.mode"] = (f"-m {module}", point.mode)
        result.translated.append(KeyLine(f"-m {module}: {point.reason}", None, "trainer.mode", point.mode,
                                         implied=True))

    def apply(verl_key: str, value: Any, from_default: bool) -> None:
        found = lookup(verl_key, table)
        if found is None:
            raise _unknown_key(verl_key)
        pattern, entry = found
        if isinstance(entry, NoEquivalent):
            result.no_equivalent.append(KeyLine(verl_key, value, reason=entry.reason))
            return
        source = "verl's default, which the command leaves out" if from_default else "verl command line"
        if isinstance(entry, Refused) and value not in entry.values:
            raise ConfigError(f"{verl_key}={_show(value)} ({source}) has no equivalent: {entry.reason}")
        if isinstance(entry, SameAsOurs):
            target = result.already_ours if value in entry.values else result.no_equivalent
            target.append(KeyLine(verl_key, value, reason=entry.reason))
            return
        assert isinstance(entry, Rename)
        try:
            ours = entry.convert(value, context)
        except NoEquivalentValue as reason:
            result.no_equivalent.append(KeyLine(verl_key, value, reason=str(reason), from_verl_default=from_default))
            return
        except RefusedValue as reason:
            raise ConfigError(f"{verl_key}={_show(value)} ({source}) {reason}") from None
        except (TypeError, ValueError, AttributeError) as error:  # a value of the wrong kind (a number for a list)
            raise ConfigError(f"{verl_key}={_show(value)} (verl command line) is not a value verl takes for it "
                              f"({error}); check its type in verl's ppo_trainer.yaml") from error
        target_key = our_key(pattern, entry, verl_key)
        if ours is UNSET:
            if not from_default:  # a verl default not carried over goes unmentioned, as one equal to ours does
                result.already_ours.append(KeyLine(verl_key, value, reason=f"{target_key} keeps its default"))
            return
        if from_default and (ours == _default_of(target_key) or target_key in sources):
            return  # a key the command gives wins over another key's verl default
        is_our_default = ours == _default_of(target_key)
        if target_key in sources and sources[target_key][1] != ours:
            other_key, other_value = sources[target_key]
            raise ConfigError(f"{verl_key}={_show(value)} and {other_key} (verl command line) both set "
                              f"{target_key}, to {_show(ours)} and {_show(other_value)}; keep one of them")
        sources[target_key] = (verl_key, ours)
        if not is_our_default:
            _set(result.tree, target_key, ours)
        result.translated.append(KeyLine(verl_key, value, target_key, ours, from_verl_default=from_default,
                                         our_default=is_our_default,
                                         note=entry.note(value, context) if callable(entry.note) else entry.note))

    for verl_key, value in given.items():
        apply(verl_key, value, from_default=False)
    for verl_key, entry in table.items():
        if isinstance(entry, Rename) and entry.has_verl_default and verl_key not in given:
            apply(verl_key, entry.verl_default, from_default=True)
    for target_key, value, reason in implied_settings(context):
        if target_key not in sources and value != _default_of(target_key):
            _set(result.tree, target_key, value)
            result.translated.append(KeyLine(reason, None, target_key, value, implied=True))
    return result


ONE_SAMPLE_IN_VERL = {
    "grpo": "each sample's score is its advantage, as verl gives a group of one mean 0 and std 1",
    "rloo": "each sample's score is its advantage, with no other sample to leave out",
}
"""What verl's group estimators do with one sample a prompt, where reinforge's refuse it."""


def check_samples_per_prompt(translation: VerlTranslation, config: Config, needs_groups: Callable[[str], bool]) -> None:
    """Refuse, naming verl's key, the one sample a prompt (verl's rollout.n default) of an estimator that compares
    a prompt's samples (``needs_groups(name)``, from the estimators' registry), before reinforge's own check does
    in terms of our rollout.n."""
    line = next((line for line in translation.translated if line.our_key == "rollout.n"), None)
    estimator = config.algorithm.adv_estimator
    if line is None or config.rollout.n != line.our_value or config.rollout.n >= 2 or not needs_groups(estimator):
        return
    source = "verl's default; the command leaves it out" if line.from_verl_default else "verl command line"
    verl_runs = ONE_SAMPLE_IN_VERL.get(estimator, "each prompt is a group of one")
    raise ConfigError(f"actor_rollout_ref.rollout.n={config.rollout.n} ({source}) gives algorithm.adv_estimator="
                      f"{estimator} one sample a prompt; verl runs it ({verl_runs}), reinforge's {estimator} compares "
                      "samples of one prompt and needs 2 or more: pass actor_rollout_ref.rollout.n=N with N >= 2 "
                      "(verl's GRPO examples use 5)")


def _leaves(key: str, value: Any) -> list[str]:
    if isinstance(value, Mapping) and value:
        return [leaf for inner, item in value.items() for leaf in _leaves(f"{key}.{inner}", item)]
    return [key]


OUR_SECTIONS_IN_VERL = {"actor": "actor_rollout_ref.actor", "rollout": "actor_rollout_ref.rollout",
                        "ref": "actor_rollout_ref.ref", "model": "actor_rollout_ref.model"}
"""Our sections and where verl keeps the same settings (data, algorithm, critic, trainer have one name)."""


def verl_leaf_hint(key: str) -> str | None:
    """For one of our sections given a verl key's last part (actor.ppo_mini_batch_size): what verl's key is here."""
    section, _, rest = key.partition(".")
    if not rest or section not in {*OUR_SECTIONS_IN_VERL, "data", "algorithm", "critic", "trainer"}:
        return None
    verl_key = f"{OUR_SECTIONS_IN_VERL.get(section, section)}.{rest}"
    found = lookup(verl_key)
    if found is None:
        return None
    pattern, entry = found
    if isinstance(entry, Rename):
        return f"{verl_key} is verl's; reinforge calls it {our_key(pattern, entry, verl_key)}"
    return f"{verl_key} is verl's and has no equivalent here: {entry.reason}; remove it"


def verl_hint(key: str, value: Any = None) -> str | None:
    """For an unknown key of our config that is verl's: what it is called here, or why it has no equivalent.

    ``value`` is what the key was given; for a whole verl section (``actor_rollout_ref: {...}`` in a
    YAML file) the hint names the translation of one of its keys. None when the key is not verl's.
    """
    leaves = [(leaf, lookup(leaf)) for leaf in _leaves(key, value)]
    known = [(leaf, found) for leaf, found in leaves if found is not None]
    if not known:
        if key in VERL_SECTIONS or any(name.startswith(f"{key}.") for name in VERL_KEYS):
            return ("it is a section of verl's config; translate a verl command with "
                    "`reinforge config from-verl KEY=VALUE ...` or run it with `reinforge train --from-verl ...`")
        return None
    renamed = [(leaf, pattern, entry) for leaf, (pattern, entry) in known if isinstance(entry, Rename)]
    if len(leaves) > 1 or key != leaves[0][0]:
        example = ""
        if renamed:
            leaf, pattern, entry = renamed[0]
            example = f" (e.g. {leaf} is {our_key(pattern, entry, leaf)} here)"
        return ("it is verl's; translate it with `reinforge config from-verl KEY=VALUE ...` "
                f"or `reinforge train --from-verl ...`{example}")
    pattern, entry = known[0][1]
    if isinstance(entry, Rename):
        return (f"it is verl's key; reinforge calls it {our_key(pattern, entry, key)} "
                "(`reinforge train --from-verl ...` translates a whole verl command)")
    return f"it is verl's key and has no equivalent here: {entry.reason}; remove it"
