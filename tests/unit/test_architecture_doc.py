"""ARCHITECTURE.md stays a map of the code as it is (issue 41).

- Every module under ``cluster/``, ``actors/``, ``serve_app/`` and ``lab/`` is named in its
  module tables. ``__init__.py`` files count only where they hold code (more than a
  docstring): an empty package marker is not a module a reader looks for.
  A table row's first cell names modules: a path (``cluster/cache/l3/store.py``),
  then bare file names in that path's directory (``wire.py``).
- Every backticked ``*.py`` it names exists.
- Every backticked ``Class.member`` it names exists (a method, a class attribute or
  an attribute set on ``self``), so a renamed method cannot linger in the prose.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "ARCHITECTURE.md"
PACKAGES = ("cluster", "actors", "serve_app", "lab")


def prose() -> str:
    """The document without its fenced blocks (a fence's backticks would pair with prose)."""
    return re.sub(r"^```.*?^```", "", DOC.read_text(), flags=re.S | re.M)


def holds_code(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]   # the docstring
    return bool(body)


def modules() -> list[str]:
    out = []
    for top in PACKAGES:
        for p in (ROOT / top).rglob("*.py"):
            if "__pycache__" in p.parts or (p.name == "__init__.py" and not holds_code(p)):
                continue
            out.append(p.relative_to(ROOT).as_posix())
    assert len(out) > 100, f"found only {len(out)} modules under {ROOT}"
    return sorted(out)


def named_in_tables(text: str) -> set[str]:
    named = set()
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        base = None
        for token in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if "/" in token:
                named.add(token)
                base = token.rstrip("/").rsplit("/", 1)[0] if token.endswith(".py") else token.rstrip("/")
            elif base is not None:
                named.add(f"{base}/{token}")
    return named


def test_every_module_is_named():
    missing = [m for m in modules() if m not in named_in_tables(prose())]
    assert not missing, f"ARCHITECTURE.md does not name {len(missing)} modules: {missing}"


def test_every_named_python_file_exists():
    text = prose()
    named = {t for t in named_in_tables(text) if t.endswith(".py")}
    bare = {t for t in re.findall(r"`([^`\s]+\.py)`", text) if "/" not in t}
    everywhere = {p.name for top in PACKAGES for p in (ROOT / top).rglob("*.py")}
    gone = sorted(t for t in named | {t for t in re.findall(r"`([^`\s]+\.py)`", text) if "/" in t}
                  if not (ROOT / t).is_file())
    gone += sorted(t for t in bare if t not in everywhere)
    assert not gone, f"ARCHITECTURE.md names files that do not exist: {gone}"


def class_members() -> dict[str, set[str]]:
    members: dict[str, set[str]] = {}
    for top in PACKAGES:
        for p in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if not isinstance(node, ast.ClassDef):
                    continue
                found = members.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        found.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        found.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        found.update(t.id for t in item.targets if isinstance(t, ast.Name))
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        found.add(sub.attr)
    return members


def test_every_named_class_member_exists():
    members = class_members()
    wrong = []
    for token in set(re.findall(r"`([^`]+)`", prose())):
        m = re.fullmatch(r"([A-Z][A-Za-z0-9]*)\.([a-z_][A-Za-z0-9_]*)(?:\(\))?", token)
        if m and m.group(2) not in members.get(m.group(1), ()):
            wrong.append(token)
        for part in re.findall(r"\b([A-Z][A-Za-z0-9]*)\.([a-z_][a-z0-9_]*)/([a-z_][a-z0-9_]*)\b", token):
            wrong += [f"{part[0]}.{name}" for name in part[1:] if name not in members.get(part[0], ())]
    assert not wrong, f"ARCHITECTURE.md names members that do not exist: {sorted(wrong)}"


def test_the_checks_see_a_missing_module_and_a_stale_name(tmp_path):
    """The rules above on a made-up row: a bare name resolves in its row's directory."""
    row = "| `cluster/cache/l3/store.py`, `wire.py` | x | |\n| `cluster/routing/` | y | |"
    assert named_in_tables(row) == {"cluster/cache/l3/store.py", "cluster/cache/l3/wire.py", "cluster/routing/"}
    assert "cluster/cache/l3/memory.py" not in named_in_tables(row)
    assert "_deliver" not in class_members()["EngineLoop"]
    assert "_deliver_all" in class_members()["EngineLoop"]
