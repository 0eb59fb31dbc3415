"""The layout's import arrows, read from the source (no MPI, nothing imported), and the front door: README's
"Use" program runs as written, on 2 ranks.

experiments/ holds entry scripts at its top and library packages below them (corpora -> training -> measuring);
fsdp_mpi/ is the layer they all stand on and imports none of them. A circle of imports, or an arrow into
experiments/ or models/ from fsdp_mpi/, fails here with the modules named. setup.cfg installs fsdp_mpi's packages
and models/ as fsdp_mpi_models; a package folder it leaves out would be missing from an installed (not editable) copy.
"""

import ast
import configparser
import re
import sys
from pathlib import Path

import pytest
from mpi_launch import REPO_ROOT, check_ok, run_mpi

EXPERIMENTS = REPO_ROOT / "experiments"
CORE = REPO_ROOT / "fsdp_mpi"


def module_name(path: Path, root: Path) -> str:
    """'training.loop' for experiments/training/loop.py, 'training' for its __init__.py, 'eval' for eval.py."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, root: Path) -> set[str]:
    """Every module `path` imports, absolute, and for ``from X import Y`` also ``X.Y`` (Y may be a module)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y inside a package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def experiments_graph() -> dict[str, set[str]]:
    """Each module under experiments/ and the modules under experiments/ it imports."""
    paths = {module_name(path, EXPERIMENTS): path for path in EXPERIMENTS.rglob("*.py")}
    return {name: {imported for imported in imported_names(path, EXPERIMENTS) if imported in paths and imported != name}
            for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of arrows in `graph` (its nodes in order, the first repeated at the end), or None."""
    state = dict.fromkeys(graph, "new")
    trail: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        trail.append(node)
        for target in sorted(graph[node]):
            if state[target] == "open":
                return trail[trail.index(target):] + [target]
            if state[target] == "new" and (cycle := visit(target)):
                return cycle
        trail.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if state[node] == "new" and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_circle_and_passes_a_ladder():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_module_under_experiments_imports_in_a_circle():
    graph = experiments_graph()
    assert "training.loop" in graph and "run_gpt2" in graph, sorted(graph)  # the walk reached the packages
    cycle = find_cycle(graph)
    assert cycle is None, "experiments/ imports in a circle: " + " -> ".join(cycle)


def fsdp_mpi_graph(core: Path) -> dict[str, set[str]]:
    """Each module of fsdp_mpi/ (a package as its __init__) and the modules of fsdp_mpi/ it imports: ``from
    package import name`` runs the package's __init__ and reads it, so it is an arrow to the package."""
    paths = {module_name(path, core.parent): path for path in core.rglob("*.py")}
    return {name: {imported for imported in imported_names(path, core.parent) if imported in paths and imported != name}
            for name, path in paths.items()}


def test_no_module_of_fsdp_mpi_imports_in_a_circle_through_its_package(tmp_path):
    """fsdp_mpi/ as it is, and a copy in which the backend's process group takes its composed collectives from the
    package (whose __init__ imports the group): the circle that copy makes is found."""
    graph = fsdp_mpi_graph(CORE)
    assert "fsdp_mpi.distributed" in graph and "fsdp_mpi.sharding.lifecycle" in graph, sorted(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "fsdp_mpi/ imports in a circle: " + " -> ".join(cycle)
    import shutil
    copy = tmp_path / "fsdp_mpi"
    shutil.copytree(CORE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    group = copy / "distributed" / "process_group.py"
    group.write_text(group.read_text().replace("import fsdp_mpi.distributed.composed as composed",
                                               "from fsdp_mpi.distributed import composed", 1))
    assert find_cycle(fsdp_mpi_graph(copy)) == ["fsdp_mpi.distributed", "fsdp_mpi.distributed.groups",
                                                "fsdp_mpi.distributed.process_group", "fsdp_mpi.distributed"]


def test_experiments_packages_import_one_way_and_never_an_entry_script():
    graph = experiments_graph()
    packages = {name.split(".")[0] for name in graph if "." in name}
    arrows: dict[str, set[str]] = {package: set() for package in packages}
    for name, targets in graph.items():
        if "." not in name:
            continue  # an entry script may import anything
        scripts = sorted(target for target in targets if "." not in target and target not in packages)
        assert not scripts, f"library module {name} imports the entry script(s) {scripts}"
        arrows[name.split(".")[0]] |= {target.split(".")[0] for target in targets} - {name.split(".")[0]}
    cycle = find_cycle(arrows)
    assert cycle is None, "experiments' packages import each other in a circle: " + " -> ".join(cycle)


def test_fsdp_mpi_never_imports_experiments_or_models():
    outside = {"experiments", "models", "fsdp_mpi_models"} | {name.split(".")[0] for name in experiments_graph()}
    offending = {}
    for path in CORE.rglob("*.py"):
        names = {name.split(".")[0] for name in imported_names(path, REPO_ROOT)}
        if names & outside:
            offending[str(path.relative_to(REPO_ROOT))] = sorted(names & outside)
    assert list(CORE.rglob("*.py")), CORE
    assert not offending, f"fsdp_mpi/ must stand alone: {offending}"


def test_setup_cfg_installs_every_package_and_the_models_under_the_projects_name():
    setup = configparser.ConfigParser()
    setup.read(REPO_ROOT / "setup.cfg")
    listed = set(setup["options"]["packages"].split())
    mappings = [line.replace(" ", "").split("=") for line in setup["options"]["package_dir"].splitlines()]
    package_dir = dict(mapping for mapping in mappings if mapping != [""])
    folders = {".".join(path.parent.relative_to(REPO_ROOT).parts) for path in CORE.rglob("__init__.py")}
    assert listed == folders | {"fsdp_mpi_models"}, f"setup.cfg's packages {sorted(listed)}, the folders {sorted(folders)}"
    assert package_dir == {"fsdp_mpi_models": "models"}, package_dir
    assert (REPO_ROOT / "models" / "__init__.py").is_file()


def test_the_torch_and_python_range_is_said_alike_where_it_is_declared_and_where_ci_tests_it():
    """setup.cfg's floors are the oldest torch and Python CI installs (the Makefile's TESTED_TORCH, .ci/run's
    Pythons), and README gives the range CI tests."""
    setup = configparser.ConfigParser()
    setup.read(REPO_ROOT / "setup.cfg")
    makefile, ci, readme = (REPO_ROOT / name for name in ("Makefile", ".ci/run", "README.md"))
    oldest, newest = re.search(r"^TESTED_TORCH := (\S+) (\S+)$", makefile.read_text(), re.M).groups()
    requires = dict(re.match(r"(\w+)(.*)", line.strip()).groups()
                    for line in setup["options"]["install_requires"].splitlines() if line.strip())
    assert requires["torch"] == ">=" + oldest.rsplit(".", 1)[0], (requires["torch"], oldest)
    pythons = re.findall(r"python_of (3\.\d+)\)", ci.read_text())
    assert setup["options"]["python_requires"] == ">=" + pythons[0], (setup["options"]["python_requires"], pythons)
    assert f"Python {pythons[0]} to {pythons[1]} and torch {oldest} to {newest}" in readme.read_text()


def test_every_entry_script_says_what_it_is_for_and_is_listed():
    listing = (EXPERIMENTS / "README.md").read_text()
    for path in sorted(EXPERIMENTS.glob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert docstring.strip(), f"{path.name} has no docstring saying what it is for"
        assert f"`{path.name}`" in listing, f"experiments/README.md does not list {path.name}"


# fsdp_mpi's layers, lowest first; a layer imports only layers before it in this list (loop and files: not
# each other; elastic stands on all four). Within a layer, the order is the one its package docstring gives ("Read in this order: a -> b").
CORE_LAYERS = ("communication", "sharding", ("loop", "files"), "elastic")


def reading_order(package: Path) -> list[str]:
    """The modules of `package` in the order its docstring gives ("Read in this order: a -> b/ -> c"), a
    subpackage's (``b/``) in its own order in its place: ["a", "b.x", "b.y", "c"]. Every module of the
    package and its subpackages must be listed."""
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    listed = [name.strip() for name in docstring.split("Read in this order:")[1].split(".")[0]
              .replace("\n", " ").split("->")]
    order = []
    for name in listed:
        if name.endswith("/"):
            order += [f"{name[:-1]}.{inner}" for inner in reading_order(package / name[:-1])]
        else:
            order.append(name)
    modules = sorted(".".join(path.relative_to(package).with_suffix("").parts) for path in package.rglob("*.py")
                     if path.stem != "__init__")
    assert sorted(order) == modules, f"{package.relative_to(REPO_ROOT)}'s reading order lists {order}, not {modules}"
    return order


def test_fsdp_mpi_layers_import_downwards_in_their_reading_order():
    rank = {}
    for level, layers in enumerate(CORE_LAYERS):
        for layer in (layers,) if isinstance(layers, str) else layers:
            order = reading_order(CORE / layer)
            rank.update({f"fsdp_mpi.{layer}.{name}": (level, layer, position) for position, name in enumerate(order)})
    wrong = []
    for name, (level, layer, position) in rank.items():
        path = CORE.joinpath(*name.split(".")[1:]).with_suffix(".py")
        for imported in imported_names(path, REPO_ROOT) & set(rank):
            its_level, its_layer, its_position = rank[imported]
            if not (its_level < level or (its_layer == layer and its_position < position)):
                wrong.append(f"{name} imports {imported}")
    assert not wrong, "fsdp_mpi imports against its layers: " + "; ".join(sorted(wrong))


def test_the_layer_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The same check on a copy of fsdp_mpi/ in which the communicator imports the lifecycle fails."""
    import shutil
    copy = tmp_path / "fsdp_mpi"
    shutil.copytree(CORE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    comm = copy / "communication" / "comm.py"
    comm.write_text("from fsdp_mpi.sharding.lifecycle import ShardedUnit\n" + comm.read_text())
    monkeypatch.setattr(sys.modules[__name__], "CORE", copy)
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    with pytest.raises(AssertionError, match="fsdp_mpi.communication.comm imports fsdp_mpi.sharding.lifecycle"):
        test_fsdp_mpi_layers_import_downwards_in_their_reading_order()


def test_design_documents_every_module_of_each_layer_and_only_those():
    """docs/design.md's table of each layer (communication, sharding, loop, files) names every module in it, by
    its path in the layer, and no module that is not there: the map a newcomer reads matches the house."""
    design = (REPO_ROOT / "docs" / "design.md").read_text()
    for layer in ("communication", "sharding", "loop", "files", "elastic"):
        table = design.split(f"**`{layer}/`**", 1)[1].split("\n\n**`", 1)[0].split("\n\nTwo adapters", 1)[0]
        listed = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
        present = {str(path.relative_to(CORE / layer)) for path in (CORE / layer).rglob("*.py")
                   if path.name != "__init__.py"}
        assert listed == present, (layer, sorted(present - listed), sorted(listed - present))


ONE_RANK_DECIDED_IN = {"communication/transports/one_rank.py", "sharding/collectives.py"}  # OneRank; local ones


def test_one_rank_is_decided_by_the_transport_and_the_collectives_and_elsewhere_only_with_a_reason():
    """Whether a group is one rank is decided where the route is chosen (``OneRank``) and where a handle's gather
    and reduction are chosen; the layers above read it from them. Any other comparison of a world size with
    0, 1 or 2 says, in a comment on its line or the line above, why one rank needs its own way there."""
    asking = re.compile(r"world_size\s*(==|!=|<=|>=|<|>)\s*[012]\b|\b[012]\s*(==|!=|<|>)\s*\w*world_size")
    unexplained = []
    for path in sorted(CORE.rglob("*.py")):
        name = str(path.relative_to(CORE))
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            code = line.split("#", 1)[0]
            if not asking.search(code) or name in ONE_RANK_DECIDED_IN:
                continue
            said = line.partition("#")[2] + (lines[number - 1].partition("#")[2] if number else "")
            if "one rank" not in said:
                unexplained.append(f"{name}:{number + 1}: {line.strip()}")
    assert not unexplained, "asks whether a group is one rank without saying why:\n" + "\n".join(unexplained)


def readme_program() -> str:
    """The first Python block of README.md's "Use" section."""
    use = (REPO_ROOT / "README.md").read_text().split("\n## Use\n", 1)[1]
    return use.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.torch_range
@pytest.mark.one_mpi  # README's program, not the MPI library: CI's first MPI runs it
def test_readmes_use_program_runs_as_written_on_two_ranks(tmp_path):
    program = tmp_path / "use.py"
    program.write_text(readme_program())
    result = run_mpi(program, 2, cwd=tmp_path, timeout=180)
    check_ok(result)
    assert result.stdout.startswith("loss ") and "tensors in the full state dict" in result.stdout, result.stdout
    assert (tmp_path / "ckpt").is_dir()


def test_docs_list_every_environment_variable_that_settings_defines():
    """docs/api.md's table and fsdp_mpi/communication/settings.py name the same variables, and no module reads
    an FSDP_MPI_ variable of its own (each is read through settings)."""
    from fsdp_mpi.communication.settings import SETTINGS
    rows = [line for line in (REPO_ROOT / "docs" / "api.md").read_text().splitlines() if line.startswith("| `FSDP_MPI_")]
    documented = {row.split("`")[1].split("=")[0] for row in rows}
    assert documented == {setting.name for setting in SETTINGS}
    for path in (REPO_ROOT / "fsdp_mpi").rglob("*.py"):
        if path.name != "settings.py":
            assert '"FSDP_MPI_' not in path.read_text(), f"{path} names a variable: define it in settings.py"
