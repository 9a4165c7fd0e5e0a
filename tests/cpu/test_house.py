"""The import graph of the packages (read from the source, every import statement, function-level ones
too): no circle anywhere in fa_a2a, ulysses, cute_kernels and graphs, and fa_a2a's runtime (the public
face, the engine, the models) imports none of its tools (benchmarks, calibration, the X-Stage model, the
MPS launcher, the command-line helpers)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("fa_a2a", "ulysses", "cute_kernels", "graphs")
TOOLS = "fa_a2a.tools"  # and the `python -m fa_a2a.<tool>` entry points that run them:
ENTRY_POINTS = {"fa_a2a.bench", "fa_a2a.bench_block", "fa_a2a.calibrate", "fa_a2a.mps"}


def _modules() -> dict:
    """{module name: its file} of the packages."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set:
    """The modules of the packages that `name` imports (a `from pkg import sub` counts as sub)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t != name and not (path.name == "__init__.py" and t.startswith(name + ".")):
                found.add(t)
    return found


def _graph() -> dict:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_import_circle():
    graph, state, circles = _graph(), {}, []

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert circles == [], "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_runtime_imports_no_tool():
    graph = _graph()
    tools = {m for m in graph if m == TOOLS or m.startswith(TOOLS + ".")}
    runtime = [m for m in graph if m.startswith("fa_a2a") and m not in tools | ENTRY_POINTS and m != "fa_a2a"]
    assert {"fa_a2a.op", "fa_a2a.block", "fa_a2a.engine.forward", "fa_a2a.models.flux"} <= set(runtime)
    assert len(tools) >= 10 and all(graph[e] <= tools for e in ENTRY_POINTS)  # each entry point only runs its tool
    bad = {m: sorted(graph[m] & tools) for m in runtime if graph[m] & tools}
    assert bad == {}, f"runtime modules importing tools: {bad}"
    for pkg in ("ulysses", "cute_kernels", "graphs"):  # the layers under fa_a2a import nothing of it
        above = {m: sorted(d for d in graph[m] if d.startswith("fa_a2a")) for m in graph if m.startswith(pkg)}
        assert not any(above.values()), {m: d for m, d in above.items() if d}
