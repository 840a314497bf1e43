"""The package's rooms (its top-level folders) import one another in layers: ALLOWED says which room may import which,
and is the one place that says so. Every import counts, inside functions and under TYPE_CHECKING too, relative ones
resolved: a lazy import is still a dependency. Inside a room, modules import one another without circles, except the
ones KNOWN_CIRCLES lists (each must still exist, so that a broken one leaves the list). bench/ and tests/ sit beside
the rooms, outside the package: they import it, and no room imports them."""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the package root: hotneurons.<room>.<module> is ROOT/<room>/<module>.py
PACKAGE = "hotneurons"
BESIDE = {"bench", "tests"}  # top-level folders of the checkout that are not in the package (pyproject.toml)

_STAGE = {"models", "artifacts", "kernels", "weights", "common"}
ALLOWED: dict[str, set[str]] = {
    "common": set(),  # ground floor
    "weights": {"common"},  # file formats, the GGUF and safetensors readers
    "kernels": {"common", "weights"},  # Numba and Triton kernels
    "models": {"common", "weights", "kernels"},  # opening a model, its decoders, running it layer by layer
    "artifacts": {"common"},  # the run directory's schemas, the predictor file
    "runtime": {"models", "artifacts", "kernels", "weights", "common"},
    # the stages, which never import one another; export runs the runtime (RUNTIME_PUBLIC only)
    "profiler": _STAGE,
    "solver": _STAGE,
    "predictors": _STAGE,
    "relufy": _STAGE,
    "export": _STAGE | {"runtime"},
    "server": {"runtime", "common"},
}
# what a room other than the runtime's own and the server may import of the runtime: building and running it
RUNTIME_PUBLIC = {"hotneurons.runtime.load", "hotneurons.runtime.generate"}
# circles between modules of one room that stand for now (module names without "hotneurons.")
KNOWN_CIRCLES = {
    frozenset({"weights.gguf_file", "weights.gguf_source", "weights.safetensors_source", "weights.source"}),
    frozenset({"runtime.balance", "runtime.generate"}),  # TYPE_CHECKING: balance names generate.Runtime
}


def _modules() -> dict[str, Path]:
    """hotneurons.<room>.<module> -> its file, for every room (a top-level folder with an __init__.py)."""
    mods = {}
    for init in sorted(ROOT.glob("*/__init__.py")):
        room = init.parent.name
        if room in BESIDE:
            continue
        for f in sorted(init.parent.glob("*.py")):
            mods[f"{PACKAGE}.{room}" if f.stem == "__init__" else f"{PACKAGE}.{room}.{f.stem}"] = f
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]):
    """(imported module, line) for every import of the package in one file: `from a import b` is a.b where that is a
    module, else a."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods and t.startswith(PACKAGE + "."):
                t = t.rsplit(".", 1)[0]  # hotneurons.x.y.attr -> the module that holds it
            if t in mods and t != name:
                yield t, node.lineno


@lru_cache(maxsize=1)  # parsed once for all the tests
def _graph() -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    mods = _modules()
    return mods, {m: dict(_imports(m, f, mods)) for m, f in mods.items()}


def _room(module: str) -> str:
    return module.split(".")[1]


def _where(mods: dict[str, Path], src: str, dst: str, line: int) -> str:
    return f"{mods[src].relative_to(ROOT)}:{line} imports {dst}"


def _circles(nodes, edges) -> list[set]:
    """The strongly connected components of more than one node (Tarjan's, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(edges.get(root, ())))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(edges.get(w, ()))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_every_room_has_a_floor():
    rooms = {_room(m) for m in _modules()}
    assert rooms == set(ALLOWED), f"rooms without a place in ALLOWED: {sorted(rooms - set(ALLOWED))}; " \
                                  f"ALLOWED names rooms that do not exist: {sorted(set(ALLOWED) - rooms)}"


def test_rooms_import_no_circle():
    mods, graph = _graph()
    edges: dict[str, dict[str, str]] = defaultdict(dict)  # room -> room -> one import that makes the edge
    for src, targets in graph.items():
        for dst, line in targets.items():
            if _room(src) != _room(dst):
                edges[_room(src)].setdefault(_room(dst), _where(mods, src, dst, line))
    circles = _circles(sorted(edges), {r: sorted(d) for r, d in edges.items()})
    said = ["{" + ", ".join(sorted(c)) + "}: " + "; ".join(edges[a][b] for a in sorted(c) for b in sorted(edges[a])
                                                           if b in c) for c in circles]
    assert not circles, "rooms import each other in a circle: " + " | ".join(said)


def test_rooms_import_only_the_floors_below():
    mods, graph = _graph()
    wrong = []
    for src, targets in graph.items():
        room = _room(src)
        for dst, line in targets.items():
            if _room(dst) == room:
                continue
            if _room(dst) not in ALLOWED[room]:
                wrong.append(f"{_where(mods, src, dst, line)} ({room} may import {sorted(ALLOWED[room])})")
            elif _room(dst) == "runtime" and room != "server" and dst not in RUNTIME_PUBLIC:
                wrong.append(f"{_where(mods, src, dst, line)} (of the runtime, only {sorted(RUNTIME_PUBLIC)})")
    assert not wrong, "imports against the layering (tests/test_rooms.py ALLOWED):\n" + "\n".join(wrong)


def test_modules_of_a_room_import_no_new_circle():
    mods, graph = _graph()
    inner = {m: sorted(d for d in targets if _room(d) == _room(m)) for m, targets in graph.items()}
    found = {frozenset(m.removeprefix(PACKAGE + ".") for m in c) for c in _circles(sorted(inner), inner)}
    new = [c for c in found if c not in KNOWN_CIRCLES]
    said = ["{" + ", ".join(sorted(c)) + "}: " + "; ".join(
        _where(mods, f"{PACKAGE}.{a}", f"{PACKAGE}.{b}", graph[f"{PACKAGE}.{a}"][f"{PACKAGE}.{b}"])
        for a in sorted(c) for b in sorted(c) if f"{PACKAGE}.{b}" in graph[f"{PACKAGE}.{a}"]) for c in new]
    assert not new, "modules import each other in a circle: " + " | ".join(said)
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in found]
    assert not gone, f"circles in KNOWN_CIRCLES that no longer exist (remove them from the list): {gone}"


def test_no_room_imports_what_sits_beside_the_package():
    """bench/ and tests/ are not in the wheel: a room that imported them would break an installed package.
    (pi-bench's launcher, common/cli.bench_main, loads bench by name at run time, from a checkout only.)"""
    mods, _ = _graph()
    wrong = []
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in BESIDE]
    assert not wrong, "rooms import what is not in the package:\n" + "\n".join(wrong)
