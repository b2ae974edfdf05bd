"""The package's shape: every module imports on its own, and jaxspec's modules import each other
without a cycle (counting imports inside functions too)."""
import ast
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxspec")


def modules():
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def imports_of(path, names):
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in found if n in names}


def test_no_import_cycle_between_jaxspec_modules():
    mods = modules()
    graph = {m: imports_of(p, mods) - {m} for m, p in mods.items()}
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}  # a package's __init__
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for d in graph[m]:
            assert state.get(d) != "open", "import cycle: " + " -> ".join(stack + [m, d])
            if d not in state:
                visit(d, stack + [m])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [])


def test_every_module_imports_alone():
    mods = [m for m in modules() if not m.endswith("__main__")]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"

    def alone(m):  # in a fresh interpreter: nothing imported before it
        return m, subprocess.run([sys.executable, "-c", code, m], capture_output=True, text=True,
                                 env=dict(os.environ, JAX_PLATFORMS="cpu"))
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for m, r in pool.map(alone, mods):
            assert r.returncode == 0, f"{m}: {r.stderr[-500:]}"


def test_no_module_over_400_lines():
    long = {m: n for m, p in modules().items() if (n := len(open(p).read().splitlines())) > 400}
    assert not long, f"modules over 400 lines: {long}"


def test_no_machine_path_in_tracked_files():
    repo = os.path.dirname(ROOT)
    if not os.path.isdir(os.path.join(repo, ".git")):
        return  # an installed copy: nothing tracked to check
    r = subprocess.run(["git", "grep", "-n", "-I", "-E", r"/(work|root|home|Users|opt|tmp)/[A-Za-z]", "--", ".",
                        ":!tests/test_structure.py"], cwd=repo, capture_output=True, text=True)
    assert r.stdout == "", "absolute machine paths:\n" + r.stdout[:2000]
