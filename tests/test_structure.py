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


# One interpreter imports jax, numpy and flax (the bulk of every import: a fresh interpreter a
# module took 229 s for the package on CI's 2 cores) and forks a child a module; a child imports
# its module with nothing of jaxspec loaded before it, and reports a failure through a pipe.
FORKED_IMPORTS = """
import importlib, os, sys, traceback
import jax, numpy
from flax import nnx
failed = []
for m in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(m)
        except BaseException:
            os.write(w, traceback.format_exc()[-800:].encode())
            os._exit(1)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    if os.waitpid(pid, 0)[1] != 0:
        failed.append(m + ": " + err)
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_alone():
    mods = [m for m in modules() if not m.endswith("__main__")]
    r = subprocess.run([sys.executable, "-c", FORKED_IMPORTS, *mods], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-1000:]


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
