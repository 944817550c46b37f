"""The engine families of the cost model (launcher.plan.families): every profile has one, and the branches on engine
names outside the places that define the engines only go down."""

from __future__ import annotations

import ast
import os

from launcher.config.profiles import PROFILES
from launcher.plan.families import FAMILIES, family_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "launcher")
# where engine names may be compared: the engines, the cost model's families, the profile catalogue
ALLOWED = (os.path.join("plan", "families") + os.sep, "engines" + os.sep, os.path.join("config", "profiles.py"))
ENGINE_NAMES = {"amp", "deepspeed", "fsdp"} | {f.name for f in FAMILIES}

# The branches on engine names outside ALLOWED: 64 before the cost model asked the families and the layers below
# the planner read the catalogue's engine tables (launcher/config/profiles.py), none now. A new branch on an engine
# name belongs in a family (launcher/plan/families/) or in those tables.
MAX_ENGINE_BRANCHES = 0


def _strings(node: ast.AST) -> set:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def _is_zero_stage(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "zero_stage") or (
        isinstance(node, ast.Name) and node.id == "zero_stage")


def engine_branches() -> list[str]:
    """``path:line`` of every comparison against an engine or family name, or of a ``zero_stage``, in launcher/
    outside ALLOWED."""
    found = []
    for folder, _dirs, files in os.walk(PACKAGE):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, PACKAGE)
            if rel.startswith(ALLOWED):
                continue
            tree = ast.parse(open(path).read(), path)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Compare):
                    continue
                operands = [node.left, *node.comparators]
                if any(_strings(o) & ENGINE_NAMES or _is_zero_stage(o) for o in operands):
                    found.append(f"{rel}:{node.lineno}")
    return found


def test_engine_name_branches_only_go_down():
    found = engine_branches()
    assert len(found) <= MAX_ENGINE_BRANCHES, (
        f"{len(found)} branches on engine names outside plan/families, engines and config/profiles.py (at most "
        f"{MAX_ENGINE_BRANCHES}): ask the profile's family instead (launcher.plan.families.family_of)\n"
        + "\n".join(found))


def test_every_profile_of_the_catalogue_has_a_family():
    for p in PROFILES.values():
        fam = family_of(p)
        assert fam.name in {f.name for f in FAMILIES}, p.name
