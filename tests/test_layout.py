"""The house's shape: no module of the project imports one that imports it back, directly or around a circle (imports
inside functions count too: a reader follows them the same way; those under `if __name__ == "__main__":` are the
program's, run as a script, not the module's)."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = {"tests", "docs", "build"}


def modules():
    """{dotted name: path} of the project's Python files (tests left out)."""
    found = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_")) and d not in SKIP]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                found[dotted] = path
    return found


def imports(path, known):
    """The project's modules that the file at path imports, anywhere in it."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names & known


def circle_from(start, graph):
    """A list of modules start -> ... -> start along graph's edges, or None."""
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph[node]):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_module_imports_one_that_imports_it_back():
    found = modules()
    graph = {name: imports(path, set(found)) - {name} for name, path in found.items()}
    assert {"engine", "cli", "settings", "request", "server", "cpu.native", "benches.common"} <= set(graph)
    circles = [circle_from(name, graph) for name in sorted(graph)]
    assert not any(circles), " ; ".join(" -> ".join(c) for c in circles if c)


def test_a_circle_is_found_where_there_is_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circle_from("a", graph) == ["a", "b", "c", "a"] and circle_from("d", graph) is None
