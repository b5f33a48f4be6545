"""The YAML tool config (``rollout.multi_turn.tool_config_path``), in verl's shape.

```yaml
tools:
  - class_name: my_package.tools.Calculator     # a BaseTool subclass ...
    config: {timeout_s: 5}
    tool_schema:
      type: function
      function: {name: calculator, description: ..., parameters: {type: object, properties: {...}, required: [...]}}
  - class_name: my_package.tools.multiply       # ... or a typed function (schema from its docstring)
  - class_name: path/to/tools.py:lookup         # a file path works too
```

verl's own tools load as their reinforge equivalents (``VERL_TOOLS``), so a verl tool config works
as it is: ``verl.tools.gsm8k_tool.Gsm8kTool`` is ``reinforge.agent.gsm8k_tool.Gsm8kTool``, and
``verl.tools.sandbox_fusion_tools.SandboxFusionTool`` (or the ReTool recipe's subclass) is the
``code_interpreter`` tool, its config keys renamed (``sandbox_fusion_url`` -> ``sandbox_url``,
``default_timeout`` -> ``run_timeout_s``, ``num_workers`` -> ``max_concurrent_calls``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import yaml

from reinforge.agent.tools import BaseTool, FunctionTool
from reinforge.config.loader import UniqueKeyLoader, yaml_problem
from reinforge.config.schema import MultiTurnConfig

GSM8K_TOOL = "reinforge.agent.gsm8k_tool.Gsm8kTool"
CODE_INTERPRETER = "reinforge.agent.code_interpreter.CodeInterpreterTool"
VERL_TOOLS = {"verl.tools.gsm8k_tool.Gsm8kTool": GSM8K_TOOL,
              "verl.tools.sandbox_fusion_tools.SandboxFusionTool": CODE_INTERPRETER,
              "recipe.retool.retool.CustomSandboxFusionTool": CODE_INTERPRETER}
"""verl's tool classes -> ours; their entries' config keys are renamed by ``_verl_tool_config``."""
ENTRY_KEYS = ("class_name", "config", "tool_schema")
"""The keys of one entry of the 'tools' list (verl's too)."""
SANDBOX_FUSION_KEYS = {"sandbox_fusion_url": "sandbox_url", "default_timeout": "run_timeout_s",
                       "num_workers": "max_concurrent_calls", "memory_limit_mb": "memory_limit_mb", "type": "type"}
SANDBOX_FUSION_IGNORED = ("enable_global_rate_limit", "rate_limit")
"""verl's rate limit caps calls in flight across its workers; ours is max_concurrent_calls (num_workers)."""


def _verl_tool_config(class_name: str, config: dict[str, Any], where: str) -> dict[str, Any]:
    """A verl tool entry's config in our tool's keys; a key or value our tool would not honour names itself."""
    if VERL_TOOLS[class_name] != CODE_INTERPRETER:
        return config
    language = config.get("default_language", "python")
    if language != "python":
        raise ValueError(f"{where}: {class_name} config default_language={language!r}; the code_interpreter tool "
                         "runs python only")
    unknown = sorted(set(config) - set(SANDBOX_FUSION_KEYS) - set(SANDBOX_FUSION_IGNORED) - {"default_language"})
    if unknown:
        raise ValueError(f"{where}: {class_name} config has keys {', '.join(unknown)}, which the code_interpreter "
                         f"tool does not take; its verl keys are {', '.join([*SANDBOX_FUSION_KEYS, 'default_language'])}")
    return {SANDBOX_FUSION_KEYS[key]: value for key, value in config.items() if key in SANDBOX_FUSION_KEYS}


def load_tools(config: MultiTurnConfig) -> dict[str, BaseTool]:
    """The tools of ``rollout.multi_turn.tool_config_path``; none when it is not set. A tool whose own per-call
    timeout (``call_timeout_s``) is not below ``tool_timeout_s`` is refused: the loop's timeout would end every slow
    call first, and the tool's own message (a sandbox's time limit, or why the code was not run) would never reach
    the model."""
    tools = load_tool_config(config.tool_config_path) if config.tool_config_path else {}
    loop_timeout = config.tool_timeout_s
    for name, tool in tools.items():
        own = getattr(tool, "call_timeout_s", None)
        if (loop_timeout is None or isinstance(own, bool) or not isinstance(own, int | float)
                or own < loop_timeout):
            continue
        raise ValueError(f"tool {name!r} of {config.tool_config_path} has call_timeout_s={own:g}, not below "
                         f"rollout.multi_turn.tool_timeout_s={loop_timeout:g}, so the loop would end each slow call "
                         "before the tool's own timeout could tell the model why; set call_timeout_s below "
                         f"{loop_timeout:g} in the tool's config (or lower run_timeout_s / retry_budget_s, which its "
                         f"default follows), or raise rollout.multi_turn.tool_timeout_s above {own:g}")
    return tools


def load_tool_config(path: str | Path) -> dict[str, BaseTool]:
    """The tools of a YAML tool config by name; every error names the file, the entry and the fix."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"rollout.multi_turn.tool_config_path={str(path)!r} is a folder; point it at the YAML file "
                         "with a 'tools' list in it")
    if not path.is_file():  # a relative path is the working directory's, not the run config's folder's
        raise ValueError(f"rollout.multi_turn.tool_config_path={str(path)!r} does not exist (looked for "
                         f"{path.resolve()}); point it at a YAML file with a 'tools' list, by a path relative to the "
                         "working directory or absolute")
    try:
        document = yaml.load(path.read_text(), Loader=UniqueKeyLoader) or {}  # noqa: S506 (a SafeLoader)
    except UnicodeDecodeError as error:
        raise ValueError(f"the tool config {path} is not UTF-8 text (byte {error.start}: {error.reason}); "
                         "save it as UTF-8 YAML") from None
    except yaml.YAMLError as error:
        at, problem = yaml_problem(error)
        raise ValueError(f"the tool config {path} is not valid YAML{at} ({problem}); fix the file") from None
    entries = document.get("tools") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"the tool config {path} has no 'tools' list; write tools: [{{class_name: ..., "
                         "tool_schema: ...}}]")
    tools: dict[str, BaseTool] = {}
    for number, entry in enumerate(entries):
        where = f"tool {number} of {path}"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ValueError(f"{where} is {entry!r}; each tool needs a 'class_name' (package.module.Name or "
                             "file.py:Name)")
        class_name, config, schema = entry["class_name"], entry.get("config") or {}, entry.get("tool_schema")
        if not isinstance(config, dict):
            raise ValueError(f"{where}: config is {config!r}; it must be a mapping of the tool's settings "
                             "(config: {key: value, ...}) or left out")
        if class_name in VERL_TOOLS:
            config, class_name = _verl_tool_config(class_name, dict(config), where), VERL_TOOLS[class_name]
        elif class_name.startswith("verl."):  # verl's tools subclass verl's own BaseTool: none loads here
            raise ValueError(f"{where}: {class_name} is a verl tool without a reinforge equivalent (those are "
                             f"{', '.join(VERL_TOOLS)}); port it as a reinforge BaseTool subclass or a typed function "
                             "(see reinforge/agent/tools.py) and name it by package.module.Name or file.py:Name")
        unknown = sorted(map(str, set(entry) - set(ENTRY_KEYS)))
        if unknown:  # a misspelt key would silently leave the tool's defaults in force
            raise ValueError(f"{where} has key(s) {', '.join(unknown)}; a tool entry's keys are "
                             f"{', '.join(ENTRY_KEYS)}")
        target = import_object(class_name, where)
        is_class = isinstance(target, type)
        if not (issubclass(target, BaseTool) if is_class else callable(target)):
            raise ValueError(f"{where}: {class_name} is neither a BaseTool subclass nor a function")
        try:
            tool = target(config, schema) if is_class else FunctionTool(target, config, schema)
        except Exception as error:  # a tool's own check of its config, or a bug in it: name the entry
            raise ValueError(f"{where}: making {class_name} from its config {config!r} failed: "
                             f"{type(error).__name__}: {error}") from error
        if tool.name in tools:
            raise ValueError(f"{where} is named {tool.name!r}, like an earlier tool; tool names must be unique")
        tools[tool.name] = tool
    return tools


def import_object(spec: str, where: str) -> Any:
    """``package.module.Name`` or ``path/to/file.py:Name``."""
    if ":" in spec:
        file, _, name = spec.rpartition(":")
        if not Path(file).is_file():
            raise ValueError(f"{where}: the file {file!r} of {spec!r} does not exist (looked for {Path(file).resolve()}; "
                             "a relative path is the working directory's); fix the path in class_name")
        module_name = f"reinforge_tools_{abs(hash(str(Path(file).resolve())))}"
        module = sys.modules.get(module_name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(module_spec)
            try:
                module_spec.loader.exec_module(module)
            except Exception as error:
                raise ValueError(f"{where}: importing {file!r} for {spec!r} failed ({type(error).__name__}: "
                                 f"{error}); fix the file or its dependencies") from None
            sys.modules[module_name] = module
    else:
        module_path, _, name = spec.rpartition(".")
        if not module_path:
            raise ValueError(f"{where}: {spec!r} is not a dotted path (package.module.Name) or file.py:Name")
        try:
            module = importlib.import_module(module_path)
        except Exception as error:  # ImportError, SyntaxError, or anything the module raises at import
            raise ValueError(f"{where}: cannot import {module_path!r} for {spec!r} ({error})") from None
    if not hasattr(module, name):
        raise ValueError(f"{where}: {spec!r} names nothing; the module has no {name!r}")
    return getattr(module, name)
