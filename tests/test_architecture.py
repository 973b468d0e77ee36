"""docs/architecture.md matches the code: its package list, and no import runs against its arrows.

The page holds one table of the project's packages, each with the packages it may import
directly (``may import``); what a package may import is that relation's transitive
closure, so a package may use anything below what it names.  These tests read the table
from the page and every import of every module from the source (``ast``: module level,
inside functions and under ``TYPE_CHECKING`` alike), and check that

* every folder of Python code the page covers is in the table, and every package in the
  table exists;
* the table itself runs one way (no package may, through others, import itself);
* every import of one package's module by another's is allowed by the table;
* no module imports another package's private name (``from pkg.mod import _name``) or
  reads one off another package's module (``mod._name``).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "architecture.md"
#: The repository's folders as the installed package sees them (setup.cfg's package_dir).
FOLDERS = {"snapshotter": "bootseer.snapshotter", "blockstore": "bootseer.blockstore", "hotlist": "bootseer.hotlist",
           "depsnap": "bootseer.depsnap", "ckptmount": "bootseer.ckptmount", "proto": "bootseer.proto",
           "bootseer": "bootseer"}


def declared() -> dict[str, set[str]]:
    """The table of docs/architecture.md: package -> the packages it may import directly."""
    text = PAGE.read_text()
    block = re.search(r"<!-- packages -->\n```text\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```text block after <!-- packages -->"
    table: dict[str, set[str]] = {}
    for line in block.group(1).splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, _, allowed = line.partition("->")
        table[name.strip()] = set(allowed.split())
    return table


def forbidden() -> list[tuple[str, str]]:
    """The page's forbidden arrows, each (importer prefix, imported prefix): narrower than the table."""
    block = re.search(r"<!-- forbidden -->\n```text\n(.*?)```", PAGE.read_text(), re.S)
    assert block, "docs/architecture.md has no ```text block after <!-- forbidden -->"
    pairs = []
    for line in block.group(1).splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        source, _, targets = line.partition("-/->")
        pairs += [(source.strip(), target) for target in targets.split()]
    return pairs


def module_name(path: Path, repo: Path = REPO) -> str:
    parts = list(path.relative_to(repo).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    top = FOLDERS[parts[0]]
    return ".".join([top, *parts[1:]])


def modules(repo: Path = REPO) -> dict[str, Path]:
    found = {}
    for folder in FOLDERS:
        for path in sorted((repo / folder).rglob("*.py")):
            if folder == "proto" and path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            found[module_name(path, repo)] = path
    return found


def package_of(module: str, packages: set[str]) -> str | None:
    """The longest declared package ``module`` lies in."""
    best = None
    for package in packages:
        if (module == package or module.startswith(package + ".")) and (best is None or len(package) > len(best)):
            best = package
    return best


def closure(table: dict[str, set[str]]) -> dict[str, set[str]]:
    reach: dict[str, set[str]] = {}

    def visit(package: str, path: tuple[str, ...]) -> set[str]:
        assert package not in path, f"the table runs in a circle: {' -> '.join(path + (package,))}"
        if package not in reach:
            below: set[str] = set()
            for target in table.get(package, ()):
                below |= {target} | visit(target, path + (package,))
            reach[package] = below
        return reach[package]

    for package in table:
        visit(package, ())
    return reach


def imports(module: str, path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names imported from it) for every import of the project in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names if alias.name.startswith("bootseer")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("bootseer"):
                found.append((node.lineno, target, [alias.name for alias in node.names]))
    return found


def test_every_package_in_the_table_exists_and_every_code_folder_is_in_it():
    table = declared()
    known = modules()
    for package in table:
        assert any(m == package or m.startswith(package + ".") for m in known), f"{package} is in the table but not in the code"
    folders = {m for m, p in known.items() if p.name == "__init__.py"} | {"bootseer"}
    for folder in folders:
        assert package_of(folder, set(table)) is not None, f"{folder} is in no package of docs/architecture.md"


def test_the_table_runs_one_way():
    closure(declared())


def test_no_import_runs_against_the_tables_arrows():
    table = declared()
    allowed = closure(table)
    known = modules()
    wrong = []
    for module, path in known.items():
        source = package_of(module, set(table))
        for line, target, names in imports(module, path):
            candidates = [target] + [f"{target}.{n}" for n in names]
            for candidate in candidates:
                dest = package_of(candidate, set(table))
                if dest and dest != source and dest not in allowed[source]:
                    wrong.append(f"{path.relative_to(REPO)}:{line}: {source} -> {dest} ({candidate})")
                    break
    assert not wrong, "imports against docs/architecture.md:\n" + "\n".join(wrong)


def test_no_import_takes_a_forbidden_arrow():
    """The seams: what the table allows at package level, narrowed (an extension sees the layer server
    only through its extension seam and control client, never its internals)."""
    rules = forbidden()
    assert rules
    wrong = []
    for module, path in modules().items():
        for line, target, names in imports(module, path):
            for candidate in [target] + [f"{target}.{n}" for n in names]:
                for source, dest in rules:
                    if (module == source or module.startswith(source + ".")) and (
                            candidate == dest or candidate.startswith(dest + ".")):
                        wrong.append(f"{path.relative_to(REPO)}:{line}: {module} -> {candidate}")
    assert not wrong, "forbidden arrows:\n" + "\n".join(sorted(set(wrong)))


def test_no_module_uses_another_packages_private_names():
    table = set(declared())
    known = modules()
    wrong = []
    for module, path in known.items():
        source = package_of(module, table)
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}
        for line, target, names in imports(module, path):
            if package_of(target, table) == source:
                continue
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    wrong.append(f"{path.relative_to(REPO)}:{line}: imports {target}.{name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bootseer") and not node.level:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in known:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in known:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and package_of(aliases[node.value.id], table) != source):
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: reads {aliases[node.value.id]}.{node.attr}")
    assert not wrong, "private names used across packages:\n" + "\n".join(wrong)


@pytest.mark.parametrize("folder", ["tests/support", "bench", "integration"])
def test_nothing_of_the_product_imports_tests_bench_or_integration(folder):
    dotted = folder.replace("/", ".")
    wrong = [f"{path.relative_to(REPO)}:{line}" for module, path in modules().items()
             for line, target, _ in imports(module, path) if target.startswith(dotted)]
    for module, path in modules().items():
        text = path.read_text()
        if re.search(rf"^\s*(from|import) {re.escape(dotted)}\b", text, re.M):
            wrong.append(str(path.relative_to(REPO)))
    assert not wrong


#: Parameter names that, in this code, hold one of the project's own objects (a store, an engine, a
#: server, a client, ...): annotated ``Any``, such a parameter hides which object it takes, and a
#: caller can hand it anything.  A heuristic by name, kept in step with the code: the issue behind
#: it was ``snapshotter: Any`` walking ``snapshotter.backend.server.sign_key``.
PROJECT_OBJECT_NAMES = frozenset({
    "backend", "cache", "client", "engine", "fetcher", "host", "layer", "observer", "prefetch", "reader",
    "record", "server", "service", "session", "snapshotter", "source", "store", "tree", "writer",
})


def test_no_function_takes_a_project_object_as_any():
    wrong = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for argument in arguments:
                annotation = argument.annotation
                if (isinstance(annotation, ast.Name) and annotation.id == "Any"
                        and argument.arg in PROJECT_OBJECT_NAMES):
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.name}({argument.arg}: Any)")
    assert not wrong, "project objects taken as Any (name their type, or a Protocol of what is used):\n" + "\n".join(wrong)


def graph(known: dict[str, Path], package: Callable[[str], str | None]) -> dict[tuple[str, str], int]:
    """(importer package, imported package) -> number of imports, for modules ``known`` sorted
    into packages by ``package`` (None: outside every package)."""
    found: dict[tuple[str, str], int] = {}
    for module, path in known.items():
        source = package(module)
        for _line, target, names in imports(module, path):
            named = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            for candidate in named or [target]:
                dest = package(candidate)
                if source and dest and dest != source:
                    found[(source, dest)] = found.get((source, dest), 0) + 1
    return found


def arrows() -> dict[tuple[str, str], int]:
    """The package graph as the code has it, by the page's table of packages."""
    table = set(declared())
    return graph(modules(), lambda module: package_of(module, table))


def folder_arrows(repo: Path) -> dict[tuple[str, str], int]:
    """The graph of any checkout ``repo`` (an older one too: no table needed), each module's folder
    its package (containerd's generated code one package, however deep its folders)."""
    known = modules(repo)
    folders = {module: module if path.name == "__init__.py" else module.rpartition(".")[0]
               for module, path in known.items()}
    folders = {module: "bootseer.proto" if folder.startswith("bootseer.proto") else folder
               for module, folder in folders.items()}
    return graph(known, lambda module: folders.get(module) or (module if module in folders.values() else None))


def circles(arrows_: dict[tuple[str, str], int]) -> list[list[str]]:
    """The circles of a graph: each set of two or more packages that all reach one another."""
    edges: dict[str, set[str]] = {}
    for source, dest in arrows_:
        edges.setdefault(source, set()).add(dest)
    reach: dict[str, set[str]] = {}
    for start in edges:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    parts = {frozenset({node} | {other for other in reach[node] if node in reach.get(other, ())}) for node in edges}
    return sorted(sorted(part) for part in parts if len(part) > 1)


#: The modules of the two seams issue 36 cut (the fetch engine with its queue, workers and reader; the layer
#: server with its loader and warming): none of them is in a circle of module imports, TYPE_CHECKING's included.
ONE_WAY_MODULES = frozenset({
    "bootseer.fetch.engine", "bootseer.fetch.reader", "bootseer.fetch.queue", "bootseer.fetch.workers",
    "bootseer.blockstore.server.layer_server", "bootseer.blockstore.server.layer_loader",
    "bootseer.blockstore.server.warming",
})


def test_the_fetch_engine_and_the_layer_server_modules_import_in_no_circle():
    """The engine asks nothing of its reader's module but ``Reader`` (the reader asks the engine through the
    ``ReaderEngine`` Protocol), and the loader knows nothing of the layer server: module arrows run one way."""
    found = circles(graph(modules(), lambda module: module))
    wrong = [part for part in found if ONE_WAY_MODULES & set(part)]
    assert not wrong, "module import circles: " + "; ".join(" <-> ".join(part) for part in wrong)


if __name__ == "__main__":
    # python tests/test_architecture.py            the arrows between the table's packages, with import counts
    # python tests/test_architecture.py --folders [CHECKOUT]
    #                                              the arrows between folders of any checkout (an older one too),
    #                                              then the circles among them
    import sys

    if sys.argv[1:2] == ["--folders"]:
        found = folder_arrows(Path(sys.argv[2]).resolve() if len(sys.argv) > 2 else REPO)
    else:
        found = arrows()
    for (source, dest), count in sorted(found.items()):
        print(f"{source:34} -> {dest:34} {count}")
    for part in circles(found):
        print("circle: " + " <-> ".join(part))


# --------------------------------------------------------------------------- tests, integration and bench

#: The bench modules other bench modules may import (bench/__init__.py): shared parts, not benchmarks
#: (bench.readers is the checkpoint benchmark's timed child program, whose digest its driver shares;
#: bench.lazy_scenarios and bench.lazy_report are the lazy-layers benchmark's model and report).
BENCH_SHARED = frozenset({"bench.common", "bench.node", "bench.image_build", "bench.nodestats", "bench.netcap",
                          "bench.readers", "bench.lazy_scenarios", "bench.lazy_report", "bench.hot_set_cost"})


def support_side_modules() -> dict[str, Path]:
    """Every module of tests/, integration/ and bench/, by the dotted name it is imported as."""
    found = {}
    for top in ("tests", "integration", "bench"):
        for path in sorted((REPO / top).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def first_party_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import of tests, integration or bench in ``path``, anywhere in it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return [(line, target, names) for line, target, names in found
            if target.split(".")[0] in ("tests", "integration", "bench")]


def support_violations(known: dict[str, Path]) -> list[str]:
    """The rules of one support package, broken: where, and which.

    * tests/support imports nothing from ``tests/<package>``, integration or bench;
    * the unit tests (``tests/<package>``) import no integration module;
    * a bench module imports no other bench module but the shared ones (:data:`BENCH_SHARED`);
    * integration/harness.py is imported only for its own names (it re-exports none of tests/support's);
    * no module of tests, integration or bench patches ``sys.path``.
    """
    harness = known.get("integration.harness")
    own = set()
    if harness is not None:
        for node in ast.parse(harness.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Assign):
                own.update(target.id for target in node.targets if isinstance(target, ast.Name))
    wrong = []
    for module, path in known.items():
        where = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
        if re.search(r"^\s*sys\.path\.(insert|append)\(", path.read_text(), re.M):
            wrong.append(f"{where}: patches sys.path")
        for line, target, names in first_party_imports(path):
            if module.startswith("tests.support") and not target.startswith("tests.support"):
                wrong.append(f"{where}:{line}: tests/support imports {target}")
            elif module.startswith("tests.") and not module.startswith("tests.support") and target.startswith("integration"):
                wrong.append(f"{where}:{line}: a unit test imports {target}")
            elif module.startswith("bench.") and target.startswith("bench.") and target not in BENCH_SHARED:
                wrong.append(f"{where}:{line}: a benchmark imports the benchmark {target}")
            if target == "integration.harness":
                wrong += [f"{where}:{line}: {name} is not integration/harness.py's own" for name in names
                          if name.split(" ")[0] not in own]
        imports_harness = any(target == "integration" and "harness" in names
                              for _, target, names in first_party_imports(path))
        if imports_harness:
            for match in re.finditer(r"(?<![\w.])harness\.([A-Za-z_]\w*)", path.read_text()):
                if match.group(1) not in own and match.group(1) != "py":
                    wrong.append(f"{where}: harness.{match.group(1)} is not integration/harness.py's own")
    return wrong


def test_tests_integration_and_bench_share_one_support_package_that_imports_none_of_them():
    wrong = support_violations(support_side_modules())
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("module, text, rule", [
    ("tests.support.bad", "from tests.blockstore.test_blob import built\n", "tests/support imports"),
    ("tests.images.bad", "from integration import harness\n", "a unit test imports"),
    ("bench.bad", "from bench.lazy_bench import main\n", "imports the benchmark"),
    ("bench.bad", "import sys\nsys.path.insert(0, '.')\n", "patches sys.path"),
    ("integration.bad", "from integration import harness\nharness.build_oci_layout\n", "not integration/harness.py's own"),
    ("integration.bad", "from integration.harness import Stack\n", "not integration/harness.py's own"),
])
def test_the_support_rules_catch_each_way_of_breaking_them(tmp_path: Path, module: str, text: str, rule: str):
    """Each rule, broken once by a module added beside the real ones: seen to fail, naming the rule."""
    path = tmp_path / "bad.py"
    path.write_text(text)
    found = support_violations(dict(support_side_modules(), **{module: path}))
    assert [line for line in found if line.startswith("bad.py") and rule in line], found


def bare_sibling_imports(known: dict[str, Path]) -> list[str]:
    """Imports, in a module of tests, integration or bench, of a sibling module by its bare name.

    ``from readers import x`` in bench/ckpt_bench.py found bench/readers.py only while a script ran by its
    path put its own folder first on ``sys.path``; run as ``python -m bench.ckpt_bench`` it fails, and only
    when that line runs.  Every first-party import names its package: ``from bench.readers import x``.
    """
    wrong = []
    for module, path in known.items():
        siblings = {other.stem for other in path.parent.glob("*.py")} - {"__init__", path.stem}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                # a sibling that shadows a standard module (tests/support/http.py) is not one imported bare
                if name.split(".")[0] in siblings and name.split(".")[0] not in sys.stdlib_module_names:
                    where = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
                    wrong.append(f"{where}:{node.lineno}: imports its sibling {name} by its bare name")
    return wrong


def test_no_module_of_tests_integration_or_bench_imports_a_sibling_by_its_bare_name():
    wrong = bare_sibling_imports(support_side_modules())
    assert not wrong, "\n".join(wrong)


def test_a_bare_sibling_import_is_caught(tmp_path: Path):
    (tmp_path / "readers.py").write_text("")
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from readers import tensors_digest\n")
    assert bare_sibling_imports({"bench.bad": path}) == ["bad.py:2: imports its sibling readers by its bare name"]
