"""Load a run's configuration: dataclass defaults, then a YAML file, then ``a.b=c`` overrides.

OmegaConf does the merging and type coercion. Before merging, every key is checked against
the schema so a typo fails with the closest valid key ("did you mean actor.optim.lr?"), and
a value of the wrong type names the key, the value, where it came from, and the type the
schema expects.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import os
import re
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from reinforge.config.errors import ConfigError
from reinforge.config.schema import DECLARED_ROUTER_AUX_LOSS, Config
from reinforge.config.sft_schema import SFTConfig
from reinforge.config.validate import CHOICES

T = TypeVar("T")


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error: PyYAML keeps the
    last one silently, so a second ``actor:`` section further down a file replaced the first one's
    settings without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in one mapping (first on line "
                    f"{seen[key].start_mark.line + 1}); keep one of them", key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


class _YamlLoader(UniqueKeyLoader):
    """YAML 1.1 reads 0.5_5 as the number 0.55 and 1_0 as 10; here a plain value with an underscore
    stays text, so "lo_hi" thresholds (rollout_is_threshold=0.5_5) keep their meaning. A number
    field still converts such text (1_000 -> 1000). And YAML 1.1 reads 1e-3 and 1.0e3 as text (its
    floats need a dot and a signed exponent); here they are numbers, as in YAML 1.2, OmegaConf and
    Hydra, so that a setting of any type (reward.kwargs, rollout.kv_cache_gib) gets the number too."""


_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X)
"""YAML 1.1's float, with the exponent's sign optional and an exponent without a dot (1e-3), as OmegaConf reads it."""


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, re.compile(r"(?!.*_)" + (_FLOAT if tag.endswith(":float") else regexp).pattern, regexp.flags))
            if tag.endswith((":int", ":float")) else (tag, regexp)
            for tag, regexp in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def yaml_problem(error: yaml.YAMLError) -> tuple[str, str]:
    """Where a YAML error is (" at line L, column C", or "" when PyYAML gives no position) and its problem, in one
    line each: PyYAML's own message spans several lines and quotes the file."""
    mark = getattr(error, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return at, getattr(error, "problem", None) or str(error).splitlines()[0]


def load_yaml(text: Any) -> Any:
    """YAML as reinforge reads it (``_YamlLoader``: underscored numbers stay text, a repeated key is an error)."""
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader subclass)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def schema_keys(cls: type = Config, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of the schema mapped to its annotation (sections included)."""
    keys: dict[str, Any] = {}
    for name, annotation in _field_types(cls).items():
        dotted = f"{prefix}{name}"
        keys[dotted] = annotation
        inner = _unwrap_optional(annotation)
        if dataclasses.is_dataclass(inner):
            keys.update(schema_keys(inner, prefix=f"{dotted}."))
    return keys


WORD_VALUES = {"router_aux_loss_coef": f"'{DECLARED_ROUTER_AUX_LOSS}'"}
"""Settings of a number or a word other than auto, by their last key part: the word their messages name."""


def _type_name(annotation: Any, word: str = "'auto'") -> str:
    inner = _unwrap_optional(annotation)
    name = getattr(inner, "__name__", None) or str(inner).replace("typing.", "")
    if typing.get_origin(inner) is typing.Union:  # the schema's "auto or a value" settings: Union[bool, str] = "auto"
        args = typing.get_args(inner)
        named = " or ".join(word if arg is str else _type_name(arg) for arg in args if arg is not type(None))
        return f"{named} or null" if type(None) in args else named
    if typing.get_origin(inner) is list:
        name = f"list[{_type_name(typing.get_args(inner)[0])}]"
    elif typing.get_origin(inner) is dict:
        name = "mapping"
    return f"{name} or null" if inner is not annotation else name


def _siblings(unknown: str, known: Iterable[str]) -> dict[str, str]:
    """The valid keys of ``unknown``'s own section, by their last part."""
    section = unknown.rpartition(".")[0]
    return {key.rpartition(".")[2]: key for key in known if key.rpartition(".")[0] == section}


def close_sibling(unknown: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The key of ``unknown``'s section whose last part is closest to its last part (at least ``cutoff`` alike)."""
    siblings = _siblings(unknown, known)
    close = difflib.get_close_matches(unknown.rpartition(".")[2], list(siblings), n=1, cutoff=cutoff)
    return siblings[close[0]] if close else None


def suggest_key(unknown: str, known: Iterable[str]) -> str | None:
    """The valid key a person most likely meant: same section first, initials (learning_rate -> lr) too."""
    known = list(known)
    section, _, leaf = unknown.rpartition(".")
    siblings = _siblings(unknown, known)
    initials = "".join(part[0] for part in leaf.split("_") if part)
    if len(leaf.split("_")) > 1 and initials in siblings:
        return siblings[initials]
    close = close_sibling(unknown, known)
    if close:
        return close
    deeper = sorted((key for key in known if key.startswith(f"{section}.") and key.endswith(f".{leaf}")), key=len)
    if section and deeper:  # actor.lr -> actor.optim.lr
        return deeper[0]
    elsewhere = {key.rpartition(".")[0]: key for key in sorted(known, key=len, reverse=True)
                 if key.rpartition(".")[2] == leaf and "." in key}
    if elsewhere:  # the key in another section: data.n -> rollout.n, lr -> actor.optim.lr, critc.optim.lr -> critic's
        close = difflib.get_close_matches(section, list(elsewhere), n=1, cutoff=0.6)
        return elsewhere[close[0]] if close else elsewhere[min(elsewhere, key=len)]
    sections = {key.rpartition(".")[0] for key in known}
    leaves = [key for key in known if key not in sections]
    close = difflib.get_close_matches(unknown, leaves, n=1, cutoff=0.6)  # a setting, never a section (data.n -> data)
    return close[0] if close else None


def _check_keys(tree: Mapping[str, Any], source: str, known: dict[str, Any], prefix: str = "") -> None:
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if dotted not in known:
            from reinforge.config.verl.translate import verl_hint, verl_leaf_hint

            while isinstance(value, Mapping) and len(value) == 1:  # a.b=c from the command line: name all of it
                inner, value = next(iter(value.items()))
                dotted = f"{dotted}.{inner}"

            sibling = close_sibling(dotted, known, cutoff=0.75)
            hint = verl_hint(dotted, value) or verl_leaf_hint(dotted)
            renamed = re.search(r"reinforge calls it ([\w.]+)", hint or "")
            if renamed and renamed.group(1) not in known:  # verl's RL key, read by another command (sft, rm, dpo)
                hint = None
            if not prefix and key in ("defaults", "hydra"):  # a verl (Hydra) config file
                hint = ("Hydra's defaults list and hydra: section are not read here: a reinforge config is plain YAML "
                        "with only the keys that differ from reinforge/config/defaults.yaml (reinforge config from-verl "
                        "translates a verl command line)")
                dotted = key
            section, _, leaf = dotted.rpartition(".")
            other_command = f"{section}.{leaf.removeprefix('train_')}" if section else leaf.removeprefix("train_")
            if leaf.startswith("train_") and other_command in known:  # the RL key in sft/rm/dpo (batch_size)
                sibling = other_command
            elif f"{section}.train_{leaf}" in known:  # the sft/rm/dpo key in train (data.batch_size), not val_'s
                sibling = f"{section}.train_{leaf}"
            if sibling and (hint is None or "has no equivalent" in hint):  # a typo, not verl's Megatron key
                hint = f"did you mean {sibling}?"
            if hint is None:
                close = suggest_key(dotted, known)
                hint = f"did you mean {close}?" if close else _valid_keys(dotted, known)
            raise ConfigError(f"unknown key {dotted} ({source}); {hint}")
        annotation = known[dotted]
        inner = _unwrap_optional(annotation)
        if dataclasses.is_dataclass(inner):
            if isinstance(value, Mapping):
                _check_keys(value, source, known, prefix=f"{dotted}.")
            elif value is not None:
                raise ConfigError(f"{dotted}={value!r} ({source}) is a section; set its keys, e.g. {dotted}.<key>=...")


def _valid_keys(unknown: str, known: Iterable[str]) -> str:
    """The keys beside ``unknown``: those of its section when it has one, else the sections (the schema's own, as
    sft, rm and dpo have other sections than train's reinforge/config/defaults.yaml)."""
    section = unknown.partition(".")[0]
    if section not in known or "." not in unknown:
        return f"the sections are {', '.join(key for key in known if '.' not in key)}"
    owner = unknown.rpartition(".")[0]
    while owner not in known:
        owner = owner.rpartition(".")[0]
    return f"the keys of {owner} are {', '.join(_siblings(f'{owner}.?', known))}"


def _is_container(annotation: Any) -> bool:
    return typing.get_origin(_unwrap_optional(annotation)) in (list, dict)


def _dotlist_to_tree(overrides: Iterable[str], known: dict[str, Any] | None = None,
                     whole: set[str] | None = None) -> dict[str, Any]:
    """``a.b=c`` items as a nested tree; ``known`` (the schema's keys) tells a list or mapping cut short from text.
    ``whole`` receives the keys given a whole mapping (reward.kwargs={...}, not reward.kwargs.key=...)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item and item.startswith("~"):  # Hydra's deletion, as verl's commands write it
            raise ConfigError(f"override {item!r} (command line) deletes a key in Hydra; here every key has a default: "
                              f"leave {item[1:]} out to keep it, or set {item[1:]}=... to change it")
        if "=" not in item:
            raise ConfigError(f"override {item!r} (command line) is not of the form key=value, e.g. actor.optim.lr=1e-6")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("+")
        if not all(key.split(".")):
            raise ConfigError(f"override {item!r} (command line) has an empty key or an empty part between dots; "
                              "write section.key=value, e.g. actor.optim.lr=1e-6")
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as error:
            if raw.lstrip().startswith(("[", "{")) and known is not None and _is_container(known.get(key)):
                # a list or mapping cut short (data.train_files=[a.parquet), not text
                _, problem = yaml_problem(error)
                raise ConfigError(f"override {item!r} (command line) is not a valid YAML list or mapping ({problem}); "
                                  "write a list as [a,b] and a mapping as {a: 1}, quoted for the shell") from error
            value = raw  # text YAML cannot read (a: b: c) is the text itself
        if isinstance(value, dict) and not raw.lstrip().startswith("{"):
            value = raw  # file.py: (a trailing colon) is text, not the mapping {file.py: null}
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} (command line) sets a key below a value")
        node[parts[-1]] = value
        if whole is not None and isinstance(value, dict):
            whole.add(key)
    return tree


def _merge_layer(base: Any, tree: Mapping[str, Any], source: str, known: dict[str, Any],
                 sources: dict[str, str] | None = None, whole: set[str] | None = None) -> Any:
    """Merge ``tree`` into ``base``; ``sources`` records, for each key set, where its value came from.

    A mapping setting (reward.kwargs) given a whole mapping takes it, as a list setting takes its list (merged,
    reward.kwargs={} on the command line left every option of the file in place); ``whole`` names the keys given
    a whole mapping, None meaning every one (a YAML file's). Other mappings, from reward.kwargs.key=value, merge."""
    _check_keys(tree, source, known)
    given: set[str] = set()
    for dotted, value in _flatten(tree, known):
        if dotted in given:  # rollout.n: 4 beside a rollout: section holding n: the later one won without a word
            raise ConfigError(f"{dotted} is given twice ({source}): as a dotted key and inside its section; keep one "
                              "of them")
        given.add(dotted)
        if isinstance(value, str) and value and _is_list_of_str(known.get(dotted)):
            if "," in value:  # a list without its brackets: one item 'a,b' named no file, layer or logger
                items = ",".join(item.strip() for item in value.split(","))
                raise ConfigError(f"{dotted}={value!r} ({source}) is one text with commas; write a list as "
                                  f"{dotted}=[{items}] (quoted for the shell), or ['{value}'] for one item with a "
                                  "comma in it")
            value = [value]  # data.train_files=/x.parquet, as verl (and Hydra's users) write one file
        if isinstance(value, int) and not isinstance(value, bool) and _is_float_or_auto(known.get(dotted)):
            value = float(value)  # OmegaConf takes no int for Union[float, str] (rollout.kv_cache_gib=4)
        expected = (_type_name(known[dotted], WORD_VALUES.get(dotted.rpartition(".")[2], "'auto'"))
                    if dotted in known else "another type")
        if value == "None" and dotted in known and _unwrap_optional(known[dotted]) is not known[dotted]:
            # Python's None is YAML's (and OmegaConf's) text 'None': data.chat_template=None rendered every prompt
            # as the word None
            raise ConfigError(f"{dotted}='None' ({source}) is the text None, not no value; write null for that "
                              f"({dotted}=null, or {dotted.rpartition('.')[2]}: null in YAML)")
        if value is None and dotted in known and _is_container(known[dotted]) \
                and _unwrap_optional(known[dotted]) is known[dotted]:  # a list or mapping that may not be null
            empty = "{}" if _is_mapping(known[dotted]) else "[]"
            raise ConfigError(f"{dotted}=null ({source}) is not a valid {expected}; write {empty} for none "
                              f"({dotted}={empty}, or {dotted.rpartition('.')[2]}: {empty} in YAML)")
        if isinstance(value, bool) and _unwrap_optional(known.get(dotted)) is str:
            # OmegaConf would keep the text 'True': reward.judge.yes_token: Yes read the judge's probability of True
            raise ConfigError(f"{dotted} ({source}) was read as the boolean {str(value).lower()}, where text goes: YAML "
                              "reads yes, no, on, off, true and false so unless quoted; quote the text, e.g. "
                              f"{dotted}=\"'{'Yes' if value else 'No'}'\" on the command line, or "
                              f"{dotted.rpartition('.')[2]}: \"{'Yes' if value else 'No'}\" in YAML")
        if (_unwrap_optional(known.get(dotted)) is bool and isinstance(value, int | float) and not isinstance(value, bool)
                and value not in (0, 1)):  # OmegaConf reads any other number as true (data.shuffle=2, enable: 5)
            raise ConfigError(f"{dotted}={value!r} ({source}) is not a valid {expected}: write true or false")
        if _is_list_of_scalars(known.get(dotted)) and isinstance(value, list) and any(
                isinstance(item, list | Mapping) for item in value):  # OmegaConf checks no nested item's type
            raise ConfigError(f"{dotted}={value!r} ({source}) is not a valid {expected}: an item is itself a list "
                              "or a mapping")
        replace = isinstance(value, Mapping) and _is_mapping(known.get(dotted)) and (whole is None or dotted in whole)
        try:
            OmegaConf.update(base, dotted, value, merge=not replace)
        except OmegaConfBaseException as error:
            if dotted in CHOICES:  # null or a list where a word goes: name the words, as for a word of no meaning
                raise ConfigError(f"{dotted}={value!r} ({source}) is not one of {', '.join(CHOICES[dotted])}"
                                  ) from error
            raise ConfigError(f"{dotted}={value!r} ({source}) is not a valid {expected}") from error
        if sources is not None:
            sources[dotted] = source
    return base


def _is_float_or_auto(annotation: Any) -> bool:
    """A setting of a size or auto (Union[float, str]): OmegaConf refuses a whole number there."""
    args = typing.get_args(_unwrap_optional(annotation)) if annotation is not None else ()
    return float in args and int not in args


def _is_mapping(annotation: Any) -> bool:
    return annotation is not None and typing.get_origin(_unwrap_optional(annotation)) is dict


def _is_list_of_scalars(annotation: Any) -> bool:
    inner = _unwrap_optional(annotation) if annotation is not None else None
    return typing.get_origin(inner) is list and typing.get_args(inner)[0] in (str, int, float, bool)


def _is_list_of_str(annotation: Any) -> bool:
    inner = _unwrap_optional(annotation) if annotation is not None else None
    return typing.get_origin(inner) is list and typing.get_args(inner) == (str,)


def _flatten(tree: Mapping[str, Any], known: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        annotation = known.get(dotted)
        is_section = annotation is not None and dataclasses.is_dataclass(_unwrap_optional(annotation))
        if isinstance(value, Mapping) and is_section:
            yield from _flatten(value, known, prefix=f"{dotted}.")
        elif value is None and is_section:  # a YAML section whose keys are all commented out sets nothing
            continue
        else:
            yield dotted, value


PATH_KEYS = ("reward.custom_function", "rollout.multi_turn.tool_config_path", "trainer.output_dir", "trainer.resume")
"""Settings naming a file or folder that nothing expanded ``~`` in: here it is the home folder, as in a shell
(trainer.output_dir=~/runs/x wrote to a folder named ``~`` in the working directory). model.path and the data files
are expanded where they are read and recorded as given, so that resuming a run compares them as they were."""


def _expand_home(config: Any) -> None:
    """Expand a leading ``~`` in the ``PATH_KEYS`` that ``config`` has (in place), so config.yaml records real paths."""
    for dotted in PATH_KEYS:
        *sections, leaf = dotted.split(".")
        owner = config
        for section in sections:
            owner = getattr(owner, section, None)
        if owner is None or not hasattr(owner, leaf):
            continue
        value = getattr(owner, leaf)
        if isinstance(value, str) and value.startswith("~"):
            setattr(owner, leaf, os.path.expanduser(value))
        elif isinstance(value, list):
            setattr(owner, leaf, [os.path.expanduser(item) if isinstance(item, str) and item.startswith("~") else item
                                  for item in value])


TEMPLATE_MARKUP = ("{{", "{%")
"""What every Jinja chat template holds: a text without either renders every conversation as itself."""


def _read_chat_template_file(config: Any, sources: Mapping[str, str]) -> None:
    """``data.chat_template`` given as the path of a template file (a ``.jinja`` as TRL's chat_template_path names
    one) replaced by the file's text, in place; a value that is neither a template nor a file is one line (a template
    with no ``{{`` or ``{%`` would render every prompt as that text)."""
    data = getattr(config, "data", None)
    value = getattr(data, "chat_template", None)
    if not isinstance(value, str) or any(markup in value for markup in TEMPLATE_MARKUP):
        return
    path = Path(value.strip()).expanduser()
    source = f" ({sources['data.chat_template']})" if "data.chat_template" in sources else ""
    if not value.strip() or "\n" in value or not path.is_file():
        raise ConfigError(f"data.chat_template={value[:80]!r}{source} is neither a Jinja chat template (it has no {{{{ "
                          "or {%) nor a file, so every conversation would render as that text; give the template's "
                          "text, the path of a template file, or null for the tokenizer's own")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"data.chat_template={value!r}{source} names a file that cannot be read as UTF-8 text "
                          f"({error}); save the template as UTF-8") from None
    if not any(markup in text for markup in TEMPLATE_MARKUP):
        raise ConfigError(f"data.chat_template={value!r}{source} names {path}, which holds no Jinja chat template "
                          "(no {{ or {%); give a template file, or null for the tokenizer's own")
    data.chat_template = text


@functools.cache
def _schema_defaults(schema: type) -> Any:
    """``OmegaConf.structured(schema)``, built once: a copy of it takes a sixth of the time of building it again."""
    return OmegaConf.structured(schema)


def load_structured(schema: type[T], path: str | Path | None = None, overrides: Iterable[str] = (),
                    tree: Mapping[str, Any] | None = None, tree_source: str = "translated from verl",
                    sources: dict[str, str] | None = None) -> T:
    """An instance of the dataclass ``schema``: its defaults, then the YAML at ``path``, then the nested
    sections ``tree`` (named ``tree_source`` in errors), then ``a.b=c`` overrides. ``sources`` receives, for each
    key set, where its value came from ("from run.yaml", "command line")."""
    known = schema_keys(schema)
    merged = copy.deepcopy(_schema_defaults(schema))  # the layers below update it in place
    sources = {} if sources is None else sources
    if path is not None:
        path = Path(path).expanduser()  # a quoted ~/run.yaml, or one from Python, as a shell reads it
        if path.is_dir():
            raise ConfigError(f"config file {path} is a folder; pass a YAML file such as examples/grpo_gsm8k.yaml")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist (looked for {path.resolve()}); pass a YAML file "
                              "such as examples/grpo_gsm8k.yaml, which reinforge init writes")
        raw = path.read_bytes()
        try:  # UTF-8 whatever the locale, as YAML is written
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            line = raw.count(b"\n", 0, error.start) + 1
            raise ConfigError(f"{path} has a byte that is not UTF-8 (0x{raw[error.start]:02x}) on line {line}; save "
                              "the file as UTF-8") from None
        try:
            file_tree = load_yaml(text) or {}
        except yaml.YAMLError as error:
            at, problem = yaml_problem(error)
            raise ConfigError(f"{path} is not valid YAML{at}: {problem}; fix the file") from error
        if not isinstance(file_tree, Mapping):
            raise ConfigError(f"{path} must hold a mapping of sections (data:, actor:, ...), "
                              f"not {type(file_tree).__name__}")
        merged = _merge_layer(merged, file_tree, f"from {path.name}", known, sources)
    if tree:
        merged = _merge_layer(merged, tree, tree_source, known, sources)
    overrides = list(overrides)
    if overrides:
        whole: set[str] = set()
        command_line = _dotlist_to_tree(overrides, known, whole)
        merged = _merge_layer(merged, command_line, "command line", known, sources, whole)
    try:
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:  # an ${interpolation} that does not resolve, a ??? left unset
        raise ConfigError(_resolution_problem(error, merged, sources)) from error
    _expand_home(config)
    _read_chat_template_file(config, sources)
    return config  # type: ignore[return-value]


def _resolution_problem(error: OmegaConfBaseException, merged: Any, sources: dict[str, str]) -> str:
    """One line for a value OmegaConf could not resolve: the key, its text, where it came from and the fix."""
    problem = " ".join(str(error).split("full_key:")[0].split())
    if len(problem) > 160:  # a section dereferenced as text quotes all of it
        problem = problem[:157] + "..."
    key = getattr(error, "full_key", None)
    node = merged if key else None
    for part in (key or "").split("."):
        node = node._get_node(part) if node is not None and OmegaConf.is_config(node) else None
    if not key or node is None:
        return f"the config cannot be resolved: {problem}; check its ${{...}} references and ??? values"
    source = sources.get(key, "the schema's default")
    if isinstance(error, MissingMandatoryValue):
        return f"{key}=??? ({source}) is a value left to fill in; set {key}=..."
    return (f"{key}={node._value()!r} ({source}) cannot be resolved: {problem}; fix the ${{...}} reference (a key "
            "of this config, or ${oc.env:NAME} of a variable that is set)")


def load_config(path: str | Path | None = None, overrides: Iterable[str] = (), validate: bool = True,
                tree: Mapping[str, Any] | None = None, tree_source: str = "translated from verl") -> Config:
    """The RL run's config: defaults, then the YAML file at ``path`` (if any), ``tree``, then ``overrides``."""
    sources: dict[str, str] = {}
    config = load_structured(Config, path, overrides, tree, tree_source, sources)
    if validate:
        from reinforge.config.validate import validate_config

        with naming_sources(sources):
            validate_config(config)
    return config


@contextlib.contextmanager
def naming_sources(sources: Mapping[str, str]) -> Iterator[None]:
    """A check's ConfigError that opens with ``key=value`` names where that key was set (``sources``, from
    ``load_structured``): the run's file or the command line, as an unknown key or a wrong type is named."""
    try:
        yield
    except ConfigError as error:
        opening = re.match(r"([\w.]+)=", str(error))
        key = opening.group(1) if opening else None
        if key not in sources or f"({sources[key]})" in str(error):
            raise
        raise ConfigError(f"{error} ({key}: {sources[key]})") from error


def load_sft_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> SFTConfig:
    """The SFT run's config: defaults, then the YAML file at ``path`` (if any), then ``overrides``, then checks."""
    from reinforge.config.validate import validate_sft_config

    sources: dict[str, str] = {}
    config = load_structured(SFTConfig, path, overrides, sources=sources)
    with naming_sources(sources):
        validate_sft_config(config)
    return config


def config_to_dict(config: Any) -> dict[str, Any]:
    """The config dataclass as plain nested dicts and lists, as ``OmegaConf.to_container(OmegaConf.structured(config),
    resolve=True)`` gives it.

    A config whose every value already has its field's type (one that ``load_config`` returned) is walked directly,
    a hundred times faster than building OmegaConf's nodes (which a run does several times: tracker, checkpoints,
    resume checks); one holding a value OmegaConf would convert (an int in a float field, a path in a text field)
    or resolve (``${...}``) goes through OmegaConf.
    """
    try:
        return _plain(config, type(config))
    except _NotPlain:
        return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)  # type: ignore[return-value]


class _NotPlain(Exception):
    """A value that OmegaConf would convert or resolve on its way into a container."""


_EXACT = (bool, int, float, str)


@functools.cache
def _plain_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    ignored = {field.name for field in dataclasses.fields(cls) if field.metadata.get("omegaconf_ignore") is True}
    return tuple((name, annotation) for name, annotation in _field_types(cls).items() if name not in ignored)


def _plain(value: Any, annotation: Any) -> Any:
    """``value`` as OmegaConf's container holds it, when it already has the type of ``annotation``; else _NotPlain."""
    if annotation is Any:
        if value is None or type(value) in _EXACT:
            return _plain_scalar(value)
        if isinstance(value, dict):
            return _plain(value, dict[str, Any])
        if isinstance(value, list):
            return _plain(value, list[Any])
        raise _NotPlain
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    if options:
        if value is None and type(None) in options:
            return None
        inner = _unwrap_optional(annotation)
        if inner is not annotation:  # Optional[X]
            return _plain(value, inner)
        if type(value) in options and type(value) in _EXACT:  # a union of scalars holding one of them
            return _plain_scalar(value)
        raise _NotPlain
    if annotation in _EXACT:
        if type(value) is not annotation:
            raise _NotPlain
        return _plain_scalar(value)
    origin = typing.get_origin(annotation)
    if origin is list and type(value) is list:
        [item_type] = typing.get_args(annotation) or (Any,)
        return [_plain(item, item_type) for item in value]
    if origin is dict and type(value) is dict:
        key_type, item_type = typing.get_args(annotation) or (str, Any)
        if not all(type(key) is str for key in value) or key_type not in (str, Any):
            raise _NotPlain
        return {key: _plain(item, item_type) for key, item in value.items()}
    if dataclasses.is_dataclass(annotation) and type(value) is annotation:
        return {name: _plain(getattr(value, name), field_type) for name, field_type in _plain_fields(annotation)}
    raise _NotPlain


def _plain_scalar(value: Any) -> Any:
    if isinstance(value, str) and "${" in value:  # an interpolation: OmegaConf resolves it
        raise _NotPlain
    return value


def save_config(config: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (what a run records)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    try:
        temporary.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
        temporary.replace(path)
    except BaseException:  # a full disk: no part of a file is left beside the config.yaml it would have replaced
        temporary.unlink(missing_ok=True)
        raise
