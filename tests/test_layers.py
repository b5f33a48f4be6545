"""docs/architecture.md's layer table is the truth about imports, no module imports itself back, and the config
schema is a leaf.

Every module of reinforge is read with ``ast``: its imports of reinforge, lazy ones inside
functions and ``if TYPE_CHECKING:`` ones (annotations) included. The entry points
(``__main__.py``) call ``cli.main`` from anywhere and are not counted, as the table says.
"""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "reinforge"


def layer_table() -> list[tuple[str, set[str]]]:
    """(layer, the layers its row says it imports), bottom layer first."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        match = re.match(r"\| `([^`]+)` \| ([^|]*) \|", line)
        if match:
            imports = re.sub(r"\([^)]*\)", "", match.group(2)).strip()
            names = set() if imports == "nothing" else {name.strip() for name in imports.split(",")}
            rows.append((layer_name(match.group(1)), names))
    return rows


def layer_name(name: str) -> str:
    return name.removesuffix("/").removesuffix(".py")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The reinforge modules ``path`` imports (``from a import b`` counts a.b, not a, when b is a module)."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            submodules = {f"{target}.{alias.name}" for alias in node.names} & modules
            found |= submodules
            if len(submodules) < len(node.names):  # a name defined by the module (or package) itself
                found.add(target)
    return found & modules


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path, set(paths)) - {name} for name, path in paths.items()
            if path.name != "__main__.py"}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_each_layer_imports_what_its_row_says_and_only_from_rows_above():
    table = layer_table()
    order = [layer for layer, _ in table]
    assert len(order) == len(set(order)), "a layer has two rows"
    listed = {layer: imports for layer, imports in table}
    actual: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        layer = layer_of(module)
        if layer in ("cli_errors", "stop_signals"):  # held by the cli.py row
            layer = "cli"
        if layer is None:
            continue
        assert layer in listed, f"{module}: its layer {layer} has no row in docs/architecture.md"
        for target in targets:
            target_layer = layer_of(target)
            if target_layer not in (layer, "cli_errors", "stop_signals", None):
                actual.setdefault(layer, set()).add(target_layer)
                assert order.index(target_layer) < order.index(layer), (
                    f"{module} imports {target}, whose layer is not above {layer} in docs/architecture.md")
    for layer, imports in listed.items():
        assert actual.get(layer, set()) == imports, f"the {layer} row says it imports {sorted(imports)}; " \
                                                    f"it imports {sorted(actual.get(layer, set()))}"


def test_no_module_imports_itself_back():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_the_config_schema_loader_and_errors_import_nothing_above_config():
    """config/ is the bottom of every layer that takes a config: its modules import only each other."""
    graph = import_graph()
    upward = {module: sorted(target for target in targets if not target.startswith("reinforge.config"))
              for module, targets in graph.items() if module.startswith("reinforge.config")}
    assert {module: targets for module, targets in upward.items() if targets} == {}
    assert graph["reinforge.config.schema"] == set()
