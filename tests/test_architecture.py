"""The architecture the code keeps, read from the import statements of src/gputravel with ast
(nothing is imported, so the check is fast and sees function-level imports too).

FLOORS below is the one source of truth for the layering; docs/architecture.md ("Code
layering") describes it in words. A package may import only packages on lower floors, or one
on its own floor where SAME_FLOOR says so; the red team is reached only through its command;
no two packages, and no two modules, import each other, not even in a circle, and not even for
a type checker only (under ``if TYPE_CHECKING:``); and an import of project code inside a
function says on its line why it is there (``# lazy: ...``).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "gputravel"

#: Floor of each package; a module directly under gputravel/ counts as a package of its own.
FLOORS = {
    "gputravel": 0,  # the package itself (cohort/isolation.py finds the checkout through it)
    "errors": 0,
    "files": 0,
    "processes": 0,  # the one way a child process is stopped
    "crypto": 1,
    "protocol": 1,
    "transport": 2,
    "net": 2,
    "data": 2,
    "attest": 3,
    "firmware": 3,  # the emulated hardware's own processes: the TDX module, the GPU's attestation firmware
    "broker": 3,  # the emulated key broker (Trustee/KBS): its own process, like the firmware's; verifies quotes
    "driver": 3,
    "device": 3,
    "host": 3,
    "train": 3,
    "workloads": 3,  # the consortium's training code (issue 27): model, loss, batches of records
    "ddp": 3,  # data-parallel training between GPU TEEs: takes attestation as callbacks
    "manifest": 3,  # the job manifest (issue 28): what holders approve by digest; the orchestrator carries it
    "release": 3,  # the model's release (issue 28): HPKE-sealed to the recipients after a quorum of holders signs
    "holder": 4,  # the trust domains: neither imports the other
    "orchestrator": 4,
    "cohort": 5,  # launching: starts the trust domains' processes
    "jobs": 6,  # jobs on the engine
    "bench": 6,
    "fl": 6,  # the federated-learning baseline: launches Flower's processes on the cohort's links
    "redteam": 6,
    "service": 6,  # one party as a service of its own, from its TOML file: starts the engine of cohort/
    "cli": 7,
    # The in-process harness of the tests wires the real device and drivers together: above
    # every package, so nothing in src may import it.
    "testing": 8,
}
#: Imports allowed within one floor (importer, imported): each one way only.
SAME_FLOOR = {
    ("protocol", "crypto"): "messages carry channel state and SPDM payloads",
    ("device", "attest"): "the emulated GPU runs its attestation firmware (attest/gpu.py)",
    ("firmware", "attest"): "the emulated TDX module and GPU firmware sign the quotes and evidence attest/ checks",
    ("broker", "attest"): "the key broker releases a key only to a quote attest/ verifies",
    ("bench", "jobs"): "the training benchmark times the training job",
    ("bench", "fl"): "the training benchmark runs the FedAvg baseline",
    ("jobs", "service"): "the demo launches each party's own service, as a consortium deploys them",
    ("train", "ddp"): "data-parallel training wraps its model in the encrypted ring's DDP hook",
    ("train", "workloads"): "training runs the job's workload",
    ("manifest", "train"): "a job manifest names TrainConfig's own settings, and admits a concrete job",
}
REDTEAM = "redteam"
#: The one module outside the red team that may reach it, and only inside its command.
REDTEAM_DOOR = "gputravel.cli.app"
LAZY_MARK = "# lazy:"

@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. gputravel.cli.app
    target: str  # the imported module, e.g. gputravel.jobs.travel
    line: int
    in_function: bool
    typing_only: bool  # under `if TYPE_CHECKING:`: never runs
    lazy_reason: bool  # a `# lazy:` comment on one of its lines

    @property
    def where(self) -> str:
        return f"{self.module}:{self.line}"


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@cache
def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The project modules `node` imports (the module itself for `from m import name`)."""
    known = modules()
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # the project imports absolutely; a relative import is refused outright
            raise AssertionError(f"{module}:{node.lineno}: relative import; write `from gputravel.... import ...`")
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    for name in names:
        if name.split(".")[0] != ROOT:
            continue
        while name not in known and "." in name:  # `import gputravel.x.y` of a name inside x.y
            name = name.rsplit(".", 1)[0]
        yield name


@cache
def imports() -> tuple[Import, ...]:
    return tuple(imp for module, path in modules().items() for imp in _imports_of(module, path))


def _imports_of(module: str, path: Path) -> list[Import]:
    found: list[Import] = []
    source = path.read_text()
    lines = source.splitlines()

    def visit(node: ast.AST, in_function: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                span = lines[child.lineno - 1: child.end_lineno]
                lazy = any(LAZY_MARK in line for line in span)
                for target in dict.fromkeys(_targets(module, child)):
                    if target != module:
                        found.append(Import(module, target, child.lineno, in_function, typing_only, lazy))
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), inner, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), inner, typing_only)
                continue
            visit(child, inner, typing_only)

    visit(ast.parse(source, str(path)), False, False)
    return found


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> where, for imports across packages."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for imp in imports():
        a, b = package_of(imp.module), package_of(imp.target)
        if a != b:
            edges[(a, b)].append(imp.where)
    return edges


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


# ----------------------------------------------------------------------------- the checks
def unplaced() -> dict[str, list[str]]:
    return {f"unplaced: {package_of(m)}": [m] for m in modules() if package_of(m) not in FLOORS}


def redteam_reached() -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    for imp in imports():
        if package_of(imp.target) != REDTEAM or package_of(imp.module) == REDTEAM:
            continue
        if imp.module == REDTEAM_DOOR and imp.in_function:
            continue  # the `gputravel redteam` command itself
        found[f"redteam: {imp.module} -> {imp.target}"].append(imp.where)
    # A module started by name (`python -m gputravel.redteam.entry`) is reached without an import.
    for module, path in modules().items():
        if package_of(module) == REDTEAM:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith(f"{ROOT}.{REDTEAM}"):
                found[f"redteam by name: {module} -> {node.value}"].append(f"{module}:{node.lineno}")
    return found


def layer_breaches() -> dict[str, list[str]]:
    found = {}
    for (a, b), where in package_edges().items():
        fa, fb = FLOORS.get(a), FLOORS.get(b)
        if fa is None or fb is None:
            continue  # unplaced() reports it
        if fb > fa or (fb == fa and (a, b) not in SAME_FLOOR):
            found[f"layer: {a} ({fa}) -> {b} ({fb})"] = where
    return found


def package_cycles() -> dict[str, list[str]]:
    return {f"package cycle: {' '.join(c)}": c for c in cycles(set(package_edges()))}


def module_cycles(found: tuple[Import, ...] | None = None) -> dict[str, list[str]]:
    # Typing-only imports count: they never run, but two modules that name each other, even for
    # a type checker, are one tangle that cannot be read, tested or moved apart. A module that
    # needs its owner's type names a narrow Protocol of its own instead, or the type moves below both.
    edges = {(i.module, i.target) for i in (imports() if found is None else found)}
    return {f"module cycle: {' '.join(c)}": c for c in cycles(edges)}


def unexplained_lazy_imports() -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    for imp in imports():
        if imp.in_function and not imp.lazy_reason:
            found[f"lazy: {imp.module} -> {imp.target}"].append(imp.where)
    return found


def _assert_none(found: dict[str, list[str]], fix: str) -> None:
    listed = [f"{key}  (at {', '.join(where)})" for key, where in sorted(found.items())]
    assert not listed, "\n".join([*listed, fix])


def test_every_package_has_a_floor() -> None:
    _assert_none(unplaced(), "give the package a floor in FLOORS here and in docs/architecture.md")


def test_only_the_redteam_command_reaches_the_red_team() -> None:
    _assert_none(redteam_reached(), "production code never imports gputravel.redteam")


def test_packages_import_only_lower_floors() -> None:
    _assert_none(layer_breaches(), "move the code to the floor it belongs to, or invert the dependency")


def test_packages_import_no_cycle() -> None:
    _assert_none(package_cycles(), "break the cycle: one of the packages belongs lower")


def test_modules_import_no_cycle_not_even_for_typing() -> None:
    _assert_none(module_cycles(), "break the cycle: move what both need below them, give the importer "
                 "a Protocol of its own for what it uses of the other, or merge the two")


def test_function_level_imports_say_why() -> None:
    _assert_none(unexplained_lazy_imports(),
                     f"move the import to the module's top, or say why it is not there with `{LAZY_MARK} ...` on its line")


# ----------------------------------------------------------------------------- the checker itself
def test_the_scanner_sees_function_level_and_typing_only_imports() -> None:
    by_place = {(i.module, i.target): i for i in imports()}
    door = [i for i in imports() if i.module == REDTEAM_DOOR and package_of(i.target) == REDTEAM]
    assert door and all(i.in_function and i.lazy_reason for i in door)
    # cohort/trust.py names the orchestrator's config for type checkers only; the orchestrator's
    # process loads the training loop (and torch) in the one function that trains.
    trust_to_cvm = {(i.typing_only, i.in_function) for i in imports()
                    if (i.module, i.target) == ("gputravel.cohort.trust", "gputravel.orchestrator.cvm")}
    process_to_loop = {(i.typing_only, i.in_function) for i in imports()
                       if (i.module, i.target) == ("gputravel.orchestrator.process", "gputravel.train.loop")}
    assert trust_to_cvm == {(True, False)} and process_to_loop == {(False, True)}
    assert not by_place[("gputravel.host.process", "gputravel.host.mux")].typing_only
    assert ("gputravel.cli.app", "gputravel.files") in by_place


def test_a_typing_only_import_closes_a_module_cycle_within_and_across_packages() -> None:
    def imp(module: str, target: str, typing_only: bool = False) -> Import:
        return Import(f"{ROOT}.{module}", f"{ROOT}.{target}", 1, False, typing_only, False)

    within = (imp("p.shell", "p.part"), imp("p.part", "p.shell", typing_only=True))
    across = (imp("a.x", "b.y"), imp("b.y", "c.z"), imp("c.z", "a.x", typing_only=True))
    assert list(module_cycles(within)) == [f"module cycle: {ROOT}.p.part {ROOT}.p.shell"]
    assert list(module_cycles(across)) == [f"module cycle: {ROOT}.a.x {ROOT}.b.y {ROOT}.c.z"]
    assert module_cycles(within[:1] + across[:2]) == {}


def test_cycles_finds_every_strongly_connected_component() -> None:
    edges = {("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"), ("e", "d"), ("f", "a")}
    assert cycles(edges) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({("a", "b"), ("b", "c")}) == []


def test_the_layer_table_agrees_with_itself() -> None:
    for (a, b) in SAME_FLOOR:
        assert FLOORS[a] == FLOORS[b] and (b, a) not in SAME_FLOOR
    assert FLOORS[REDTEAM] > FLOORS["cohort"] and package_of(REDTEAM_DOOR) == "cli"
