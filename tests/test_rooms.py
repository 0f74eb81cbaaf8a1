"""The frontend's rooms and the direction of the arrows between them (issue 22).

`einpage` is built of rooms, subpackages with one job each: `program` (programs and
their libraries), `pipeline` (compile), `models` (model families as programs),
`workloads` (generation, training) and `cli` (the command line). A room imports only
the rooms before it in `ORDER` (and the leaf modules `einpage.errors`/`einpage.units`),
so the picture is a line with no circles; the package's facade (`einpage/__init__.py`,
`__main__.py`) and the public paths kept for users (`einpage.ops`, ...: re-exports that
define nothing) sit outside the rooms. Every import counts, also one inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "einpage"
ORDER = ("program", "pipeline", "models", "workloads", "cli")
LEAVES = ("errors", "units", "version")
FACADE = ("__init__", "__main__")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def place(module: str) -> str:
    """The room of an einpage module, or "leaf", "facade" or "public path" (a module
    that only re-exports another, wherever it sits: `einpage.models.training` too)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "facade"
    if len(parts) == 2 and parts[1] in LEAVES:
        return "leaf"
    if re_exports_only(modules_cache()[module]):
        return "public path"
    if parts[1] in ORDER:
        return parts[1]
    if parts[1] in FACADE:
        return "facade"
    return "public path"


def re_exports_only(tree: ast.Module) -> bool:
    """Whether a module is a docstring and `from X import ...` lines, nothing else."""
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    names = {a.name for node in body if isinstance(node, ast.ImportFrom) for a in node.names}
    return bool(body) and all(isinstance(n, ast.ImportFrom) for n in body) and "*" in names


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def einpage_imports(module: str, tree: ast.Module) -> set[str]:
    """The einpage modules `tree` imports (relative imports resolved), anywhere in it."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: -node.level or None]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = {f"{base}.{alias.name}" for alias in node.names}
            found |= submodules
            if not submodules & set(modules_cache()):  # names from `base`, not its modules
                found.add(base)
    known = modules_cache()
    return {name for name in found if name in known and name != module}


_CACHE: dict[str, ast.Module] = {}


def modules_cache() -> dict[str, ast.Module]:
    if not _CACHE:
        _CACHE.update(modules())
    return _CACHE


def arrows() -> list[tuple[str, str, str, str]]:
    """(from room, to room, importing module, imported module) for every import."""
    found = []
    for module, tree in modules_cache().items():
        for target in einpage_imports(module, tree):
            found.append((place(module), place(target), module, target))
    return found


def test_every_room_exists_and_every_module_has_a_place():
    rooms = {place(m) for m in modules_cache()}
    assert set(ORDER) <= rooms
    public = sorted(m for m in modules_cache() if place(m) == "public path")
    assert public, "the public paths kept for users"


@pytest.mark.parametrize("room", ORDER)
def test_a_room_imports_only_the_rooms_before_it(room):
    allowed = {*ORDER[: ORDER.index(room) + 1], "leaf"}
    wrong = [
        f"{module} imports {target} ({to})"
        for start, to, module, target in arrows()
        if start == room and to not in allowed
    ]
    assert not wrong, "\n".join(wrong)


def test_leaves_import_no_room():
    wrong = [f"{m} imports {t}" for start, to, m, t in arrows() if start == "leaf" and to != "leaf"]
    assert not wrong, "\n".join(wrong)


def test_public_paths_define_nothing():
    """A public path is a docstring and re-exports of one room's module, nothing else."""
    for module, tree in modules_cache().items():
        if place(module) != "public path":
            continue
        sources = {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
        assert len(sources) == 1 and place(sources.pop()) in ORDER, module
        assert not any(place(m) == "public path" for _, _, m2, m in arrows() if m2 == module)


def test_no_room_imports_a_public_path_or_the_facade():
    """Inside the package, code imports where things live, not their public aliases."""
    wrong = [
        f"{m} imports {t}"
        for start, to, m, t in arrows()
        if start in ORDER and to in ("public path", "facade")
    ]
    assert not wrong, "\n".join(wrong)


def test_the_rooms_form_a_line_without_circles():
    """The room graph, as `farm-studio look` would draw it: arrows only go back along
    `ORDER` (checked above), so there is no circle; this states the arrows that exist."""
    edges = {(a, b) for a, b, *_ in arrows() if a in ORDER and b in ORDER and a != b}
    for a, b in edges:
        assert ORDER.index(b) < ORDER.index(a), f"{a} -> {b}"
    assert ("workloads", "models") in edges and ("cli", "workloads") in edges
