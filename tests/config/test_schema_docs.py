"""A schema docstring that lists the names of a registry lists exactly the registry's (the registry is the one list)."""

import ast
import re
from pathlib import Path

import pytest

from reinforge.algorithms import LOSS_AGG_MODES, POLICY_LOSSES

SCHEMA = Path(__file__).parents[2] / "reinforge" / "config" / "schema.py"


def field_docstring(class_name: str, field: str) -> str:
    """The string under ``field`` in the dataclass ``class_name`` of schema.py."""
    tree = ast.parse(SCHEMA.read_text())
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name).body
    index = next(i for i, node in enumerate(body) if isinstance(node, ast.AnnAssign) and node.target.id == field)
    return body[index + 1].value.value


@pytest.mark.parametrize("class_name, field, registry", [
    ("PolicyLossConfig", "loss_mode", POLICY_LOSSES),
    ("ActorConfig", "loss_agg_mode", LOSS_AGG_MODES),
])
def test_listed_names_are_the_registry(class_name, field, registry):
    docstring = " ".join(field_docstring(class_name, field).split())
    in_parentheses = re.findall(r"\(([^()]*)\)", docstring)
    listing = (in_parentheses[-1] if in_parentheses else docstring).rstrip(".").replace(" or ", ", ")
    assert sorted(listing.split(", ")) == sorted(registry), f"{class_name}.{field}: {listing}"
