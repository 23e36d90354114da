"""The house keeps its shape: imports point down, one floor at a time.

Floors, top to bottom: the program (``radixserve/__init__``, ``cli``) and ``tools``, then
``api`` (transports) → ``serving`` → ``engine`` → ``scheduler`` | ``executor`` → ``core``.
A module may import its own floor, the floor right below it, and ``core`` (the shared
vocabulary: requests, sampling parameters, errors). ``scheduler`` and ``executor`` are
siblings that never import each other; ``tools`` and the program may use any floor and
nothing imports them. Every import counts, lazy ones inside functions too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "radixserve"

# floor -> the floors it may import (besides itself and core)
ALLOWED: dict[str, set[str]] = {
    "program": {"tools", "api", "serving", "engine", "scheduler", "executor"},
    "tools": {"api", "serving", "engine", "scheduler", "executor"},
    "api": {"serving"},
    "serving": {"engine"},
    "engine": {"scheduler", "executor"},
    "scheduler": set(),
    "executor": set(),
    "core": set(),
}


def floor_of(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "radixserve", module
    if len(parts) == 1 or parts[1] in ("cli", "__main__"):
        return "program"
    if parts[1] in ALLOWED:
        return parts[1]
    if not (PACKAGE / parts[1]).exists() and not (PACKAGE / f"{parts[1]}.py").exists():
        return "program"  # a name of radixserve/__init__ (``from radixserve import LLM``)
    raise AssertionError(f"{module}: not on any floor (add it to tests/test_layers.py)")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every radixserve import in ``path``, relative ones resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target == "radixserve":  # ``from radixserve import x``: x is the module
                found += [(node.lineno, f"radixserve.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
    return [(line, m) for line, m in found if m == "radixserve" or m.startswith("radixserve.")]


def layer_violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue  # generated gRPC stubs import only their own package
        source = floor_of(module_name(path))
        for line, target in imports_of(path):
            if target in ("radixserve.__version__", "radixserve.version"):
                continue
            dest = floor_of(target)
            if dest in (source, "core") or dest in ALLOWED[source]:
                continue
            rel = path.relative_to(PACKAGE.parent)
            bad.append(f"{rel}:{line}: {source} imports {target} ({dest})")
    return bad


def test_imports_point_down_one_floor_at_a_time():
    assert layer_violations() == []


def import_graph() -> dict[str, set[str]]:
    """Module -> the radixserve modules it imports (any import, lazy and type-only ones
    too; ``from package import module`` names the module, not the package)."""
    modules = {
        module_name(path): path
        for path in sorted(PACKAGE.rglob("*.py"))
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:  # ``from radixserve.api.openai import chat``
                    if f"{node.module}.{alias.name}" in modules:
                        targets.add(f"{node.module}.{alias.name}")
        for _, target in imports_of(path):
            while target and target not in modules:  # a name inside a module
                target = target.rpartition(".")[0]
            if target and target != "radixserve":  # (the package's own __init__: the program)
                targets.add(target)
        graph[name] = targets - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles():
    """No two modules import each other, directly or around a circle: each can be read
    (and loaded) after the ones it uses."""
    assert import_cycles(import_graph()) == []


def test_the_cycle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_the_check_catches_an_upward_and_a_skipping_import(tmp_path, monkeypatch):
    """The walker itself: an api module reaching into the executor, and an engine module
    reaching up into serving, are both reported."""
    fake = tmp_path / "radixserve"
    for rel, text in {
        "__init__.py": "",
        "api/__init__.py": "",
        "api/x.py": "from radixserve.executor.quant import QUANTIZATIONS\n",
        "engine/__init__.py": "",
        "engine/y.py": "def f():\n    from radixserve.serving import frontend\n",
        "serving/__init__.py": "",
        "serving/z.py": "from radixserve.engine import inputs\nfrom radixserve.core import errors\n",
    }.items():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert layer_violations() == [
        "radixserve/api/x.py:1: api imports radixserve.executor.quant (executor)",
        "radixserve/engine/y.py:2: engine imports radixserve.serving (serving)",
    ]


# a router started for real (uvicorn, its startup tasks), answering a request
ROUTER_RUNS = """
import socket, sys, threading, time
import httpx, uvicorn
from radixserve.api.router.server import RouterConfig, create_router_app
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
app = create_router_app(RouterConfig(workers=("http://127.0.0.1:1",)))
server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
thread = threading.Thread(target=server.run, daemon=True)
thread.start()
deadline = time.monotonic() + 30
while True:
    try:
        workers = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=2)
        break
    except httpx.HTTPError:
        assert time.monotonic() < deadline, "the router did not start"
        time.sleep(0.1)
assert workers.status_code == 200, workers.text
server.should_exit = True
# wait for the server thread to end: exiting with it still inside the event loop could
# crash the interpreter's shutdown (an exit code of -11 now and then)
thread.join(30)
assert not thread.is_alive(), "the router did not stop"
assert "torch" not in sys.modules, "torch imported"
"""


@pytest.mark.parametrize(
    "code",
    [
        # the router's help, and building its app: no torch
        "import sys\nfrom radixserve.cli import main\ntry:\n    main(['router', '--help'])\n"
        "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'\n",
        ROUTER_RUNS,
        # the top-level help lists every command without loading any of them
        "import sys\nfrom radixserve.cli import main\ntry:\n    main(['--help'])\n"
        "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'\n",
    ],
    ids=["router-help", "router-app", "top-help"],
)
def test_the_router_and_the_help_import_no_torch(code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
