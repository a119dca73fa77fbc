"""The package's layout: each folder one part of the design, imports running one way between them
(docs/architecture.md, "The modules"). Every import of ours is read from the source, function-local ones included."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "optimum_ipex_spec"

#: the parts, lowest first: what each may import besides itself
BASE = {"base"}
ALLOWED = {
    "base": set(),  # compat, facts, limits, version, utils/
    "kernels": BASE,
    "backends": BASE | {"kernels"},  # what every runner shares: base.py, eager.py, dense_weights.py
    "backends.pytorch": BASE | {"kernels", "backends"},
    "backends.ipex": BASE | {"backends"},
    "backends.choice": BASE | {"kernels", "backends", "backends.pytorch", "backends.ipex"},  # backends/__init__.py
    "loading": BASE | {"kernels", "backends", "backends.pytorch", "backends.ipex"},
    "speculative": BASE | {"kernels", "backends", "backends.pytorch", "backends.ipex"},
    "provisioning": BASE | {"kernels", "loading"},
}
ALLOWED["surface"] = set(ALLOWED) - {"surface"}  # modeling.py and the package root
ALLOWED["cli"] = set(ALLOWED) - {"cli"}


def part_of(module: str) -> str:
    """The part of the design that ``module`` (dotted, package first) belongs to."""
    parts = module.split(".")[1:]
    if not parts or parts[0] == "modeling":
        return "surface"
    if parts[0] in ("compat", "facts", "limits", "version", "utils"):
        return "base"
    if parts[0] == "backends":
        if len(parts) == 1:
            return "backends.choice"
        if parts[1] in ("pytorch", "ipex"):
            return f"backends.{parts[1]}"
        if (PACKAGE / "backends" / parts[1]).is_dir():
            raise AssertionError(f"{module}: a backend folder the layout does not know; add it (tests/test_layout.py)")
        return "backends"
    if parts[0] not in ALLOWED:
        raise AssertionError(f"{module}: a module outside the layout's parts; add it to one (tests/test_layout.py)")
    return parts[0]


def _is_module(dotted: str) -> bool:
    """Whether ``dotted`` (package first) names a module or package of ours, not a name inside one."""
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path):
    """(module, imported module) for every import of this package in the file at ``path``."""
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    is_package = relative.name == "__init__"
    module = ".".join(relative.parent.parts if is_package else relative.parts)
    return imports_in(module, is_package, path.read_text())


def imports_in(module: str, is_package: bool, text: str):
    """(module, imported module) for every import of this package in ``text``, the source of ``module``."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from <package> import name``: the module ``name`` where there is one, else the package itself
            targets = [f"{target}.{alias.name}" if node.module is None and _is_module(f"{target}.{alias.name}")
                       else target for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for imported in targets:
            if imported == PACKAGE.name or imported.startswith(PACKAGE.name + "."):
                yield module, imported


def test_imports_run_one_way_between_the_parts():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for module, imported in imports_of(path):
            source, target = part_of(module), part_of(imported)
            if source != target and target not in ALLOWED[source]:
                upward.append(f"{module} ({source}) imports {imported} ({target})")
    assert not upward, "imports against the layout's direction:\n" + "\n".join(upward)


def test_every_folder_is_a_part_of_the_design():
    folders = {p.parent.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE}
    assert folders == {"backends", "cli", "kernels", "loading", "provisioning", "speculative", "utils"}
    for folder in folders:
        assert (PACKAGE / folder / "__init__.py").is_file(), f"{folder}/ has no __init__.py"


@pytest.mark.parametrize("module, imported, reported", [
    ("optimum_ipex_spec.kernels.packed_gemm", "optimum_ipex_spec.backends.pytorch.decoder", True),
    ("optimum_ipex_spec.backends.ipex.runner", "optimum_ipex_spec.backends.pytorch.decoder", True),
    ("optimum_ipex_spec.loading.manifest", "optimum_ipex_spec.provisioning.provision", True),
    ("optimum_ipex_spec.speculative.strategy", "optimum_ipex_spec.modeling", True),
    ("optimum_ipex_spec.modeling", "optimum_ipex_spec.cli.export", True),
    ("optimum_ipex_spec.cli.export", "optimum_ipex_spec.modeling", False),
    ("optimum_ipex_spec.backends", "optimum_ipex_spec.backends.ipex.runner", False),
    ("optimum_ipex_spec.backends.pytorch.decoder", "optimum_ipex_spec.backends.base", False),
    ("optimum_ipex_spec.backends.pytorch.decoder", "optimum_ipex_spec.backends", True),  # the choice, from below
])
def test_the_rule_tells_an_upward_import(module, imported, reported):
    source, target = part_of(module), part_of(imported)
    assert (source != target and target not in ALLOWED[source]) is reported


def test_a_package_level_name_counts_as_its_package():
    """``from .. import make_runner`` in a backend imports the choice module (backends/__init__.py), not the floor."""
    text = "from .. import make_runner\nfrom ..base import Runner\nfrom . import decoder\n"
    found = sorted(imported for _, imported in imports_in("optimum_ipex_spec.backends.pytorch.probe", False, text))
    assert found == ["optimum_ipex_spec.backends", "optimum_ipex_spec.backends.base",
                     "optimum_ipex_spec.backends.pytorch.decoder"]
    assert part_of(found[0]) not in ALLOWED["backends.pytorch"]


def test_provisioning_and_the_cli_registration_import_no_torch():
    """``python -m optimum_ipex_spec.provisioning.provision --list`` / ``--check`` (run by ``make provision``) and
    ``optimum-cli``'s registration stay fast: neither imports torch."""
    for module in ("optimum_ipex_spec.provisioning.provision", "optimum_ipex_spec.cli.export_ipex"):
        probe = subprocess.run([sys.executable, "-c", f"import sys, {module}; print('torch' in sys.modules)"],
                               capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent)
        assert probe.stdout.strip() == "False", f"{module} imports torch: {probe.stderr[-2000:]}"
