"""The shape rules of the project's source (issue 41), checked on every source file
outside ``tests/``: no function over 80 lines, no union annotation with a bare
``dict`` beside another type (``str | dict``: say what the mapping holds, or parse it
into a type), no import of Ray Serve's private modules (``ray.serve._private``).

A union of a bare ``dict`` and ``None`` alone (an optional mapping) is allowed; so is
a mapping that names what it holds (``dict[int, Extent]``, ``Mapping[str, str]``)
beside another type.

``PENDING`` names exactly what still breaks a rule because its owner's rewrite is
not merged yet; each entry must still break its rule (a stale entry fails too), so
the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("cluster", "actors", "serve_app", "lab", "scripts")
MAX_FUNCTION_LINES = 80

# (rule, "path::qualified name" for functions, "path" for the others): in rewrite elsewhere.
PENDING: set[tuple[str, str]] = set()


def source_files() -> list[Path]:
    files = []
    for top in SOURCE_DIRS:
        files += [p for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts]
    assert len(files) > 100, f"found only {len(files)} source files under {ROOT}"
    return sorted(files)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def long_functions(tree: ast.AST, path: str) -> list[tuple[str, int]]:
    """``path::qualified name`` and line count of every function over the limit."""
    out = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - child.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    out.append((f"{path}::{prefix}{child.name}", lines))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def _union_members(node: ast.AST) -> list[ast.AST] | None:
    """The members of ``A | B | ...`` or ``Union[A, B]``/``Optional[A]``; None if not a union."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return (_union_members(node.left) or [node.left]) + (_union_members(node.right) or [node.right])
    if isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute)):
        name = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
        if name in ("Union", "Optional"):
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return list(items) + ([ast.Constant(None)] if name == "Optional" else [])
    return None


def _is_dict(node: ast.AST) -> bool:
    """A bare ``dict``: a mapping that does not say what it holds."""
    return isinstance(node, ast.Name) and node.id in ("dict", "Dict")


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def dict_unions(tree: ast.AST) -> list[str]:
    """Every annotation (string annotations parsed too) that is a union with a
    ``dict`` member beside a member other than None."""
    annotations = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
                if a is not None and a.annotation is not None:
                    annotations.append(a.annotation)
            if node.returns is not None:
                annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
    found = []
    for ann in annotations:
        roots = [ann]
        for node in ast.walk(ann):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                try:
                    roots.append(ast.parse(node.value, mode="eval").body)
                except SyntaxError:
                    pass
        for root in roots:
            inner = {id(c) for p in ast.walk(root) if isinstance(p, ast.BinOp) and isinstance(p.op, ast.BitOr)
                     for c in (p.left, p.right)}   # parts of a longer union: checked as that union
            for part in ast.walk(root):
                members = None if id(part) in inner else _union_members(part)
                if members and any(map(_is_dict, members)) and \
                        any(not _is_dict(m) and not _is_none(m) for m in members):
                    found.append(f"line {ann.lineno}: {ast.unparse(part)}")
    return found


def serve_private_imports(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found += [f"line {node.lineno}: {n}" for n in names if n.startswith("ray.serve._private")]
    return found


def violations() -> dict[tuple[str, str], str]:
    """(rule, where) -> what breaks it, over every source file."""
    out = {}
    for path in source_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        name = rel(path)
        for where, lines in long_functions(tree, name):
            out[("long_function", where)] = f"{lines} lines"
        for rule, hits in (("dict_union", dict_unions(tree)), ("serve_private", serve_private_imports(tree))):
            if hits:
                out[(rule, name)] = "; ".join(hits)
    return out


def test_no_function_over_80_lines_no_dict_union_no_serve_private_import():
    found = violations()
    new = {k: v for k, v in found.items() if k not in PENDING}
    assert not new, "shape rules broken (split the function / type the mapping / use Serve's public API):\n" + \
        "\n".join(f"{rule} {where}: {what}" for (rule, where), what in sorted(new.items()))


def test_every_pending_entry_still_breaks_its_rule():
    """An entry fixed by its owner leaves the list, so the list cannot hide a new break."""
    stale = sorted(PENDING - set(violations()))
    assert not stale, f"fixed: remove from PENDING in tests/unit/test_code_shape.py: {stale}"


def test_the_checks_find_what_they_look_for():
    """Each check on a snippet that breaks it and one that does not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(ast.parse(f"class C:\n  def f(self):\n{body}\n"), "m.py") == \
        [("m.py::C.f", MAX_FUNCTION_LINES + 1)]
    assert long_functions(ast.parse(f"def f():\n{body[:body.rindex(chr(10))]}\n"), "m.py") == []
    assert dict_unions(ast.parse("def f(a: str | dict | None = None) -> int: ...")) == \
        ["line 1: str | dict | None"]
    assert dict_unions(ast.parse("x: 'os._Environ | dict | None' = {}")) == \
        ["line 1: os._Environ | dict | None"]
    assert dict_unions(ast.parse("from typing import Union\ndef f(a: Union[int, dict]): ...")) == \
        ["line 2: Union[int, dict]"]
    fine = "def f(a: dict | None, b: str | Mapping[str, str]) -> dict[str, int] | int: ..."
    assert dict_unions(ast.parse(fine)) == []
    assert serve_private_imports(ast.parse("from ray.serve._private.utils import x\nimport ray.serve")) == \
        ["line 1: ray.serve._private.utils", "line 1: ray.serve._private.utils.x"]
