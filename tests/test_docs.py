"""Every ```python and ```bash block of README.md and docs/*.md runs.

Python: the blocks of one page run in order in one fresh interpreter (this venv's python) in a
temporary folder, sharing one namespace the way a reader's session does (a page exports its models
once and later blocks use them). A page whose blocks load the real models is slow-marked.

Bash: a block runs (bash -e, same temporary folder, this venv's bin/ first on PATH) only when every
command in it is known to be safe and fast (SAFE_BASH); other blocks are reported by the skip reason
that says what covers them instead (NOT_RUN_BASH). Output shown in the docs is fenced as ```text and
is never run; docs/*.md fences every block with a language.

Also checked here: `benchmarks/bench.py --render` rebuilds the report and its plots from the committed
docs/benchmarks.json without measuring anything, and the report embeds the plots.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"benchmarks.md", "version-matrix.md"}  # written by scripts; fenced by their generators
DOC_FILES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^(`{3,})([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)  # ```` fences may hold ```

#: A python block that names one of these needs the provisioned real models: its page is slow.
REAL_MODEL_MARKERS = ("smollm2", "gemma3", "path/or/hub-id", "provision(", "self_draft(")
#: Placeholders in the README's first example, replaced by the provisioned folder of a model before it runs.
PLACEHOLDERS = {'"path/or/hub-id"': "smollm2-135m-instruct"}
#: The folder docs/export-cli.md exports to; its python blocks get the one the ``cli_export_dir`` fixture made
#: with the page's own command.
CLI_EXPORT_DIR = "/tmp/smollm2-ipex"
CLI_EXPORT_COMMAND = f"optimum-cli export ipex --model smollm2-135m-instruct {CLI_EXPORT_DIR}"

#: Commands (comments stripped) that run in well under a second and write nothing outside the temp folder.
SAFE_BASH = [
    re.compile(r"optimum-cli( export( ipex)?)? --help"),
    re.compile(r"python -m optimum_ipex_spec\.provisioning\.provision --list"),
]
#: Commands that are not run here, and what runs them instead.
NOT_RUN_BASH = {
    "make demo": "about a minute of measuring; its real output is captured in docs/quickstart.md",
    "make test": "the whole test suite, this file included",
    CLI_EXPORT_COMMAND: "run (to a temporary folder) by the cli_export_dir fixture of the export-cli.md python test",
    "optimum-cli export ipex --model": "a real export + validation: tests/test_cli_export.py::test_cli_export_real_smollm2",
    "python -m optimum_ipex_spec.provisioning.provision smollm2": "provisioning: tests/test_provision.py",
    "make provision": "provisioning: tests/test_provision.py",
    "pip install": "changes the environment",
    "python benchmarks/export_memory.py": "measures for minutes in fresh processes; its figures are in docs/memory.md",
    "make bench-load": "measures load times for minutes in fresh processes; its figures are in docs/benchmarks-load.md",
    "make bench-llamacpp": "builds llama.cpp (about 20 minutes) and measures for minutes; figures in docs/gguf.md",
    "scripts/build-llamacpp.sh": "builds llama.cpp (about 20 minutes on 2 cores); make bench-llamacpp runs it",
    "python benchmarks/gguf_kernels.py": "streams a 1 GB file through both kernels for minutes; figures in docs/gguf.md",
}

RUNNER = r"""
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for block in blocks:
    where = f"{block['file']}:{block['line']}"
    print(f"===== {where}", flush=True)
    try:
        exec(compile(block["code"], where, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: the block at {where}", flush=True)
        sys.exit(1)
print("ALL BLOCKS PASSED", flush=True)
"""


def blocks(path: Path, language: str):
    """[(line number, code)] of the ``language`` blocks in ``path``."""
    text = path.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(3)) for m in FENCE.finditer(text) if m.group(2) == language]


def _env():
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _python_params():
    params = []
    for path in DOC_FILES:
        found = blocks(path, "python")
        if not found:
            continue
        real = any(marker in code for _, code in found for marker in REAL_MODEL_MARKERS)
        marks = [pytest.mark.slow] if real else []
        params.append(pytest.param(path, id=path.relative_to(ROOT).as_posix(), marks=marks))
    return params


@pytest.fixture(scope="session")
def cli_export_dir(tmp_path_factory):
    """docs/export-cli.md's real run, into a temporary folder (exit status 0 = validation PASS)."""
    output = tmp_path_factory.mktemp("cli") / "smollm2-ipex"
    command = CLI_EXPORT_COMMAND.replace(CLI_EXPORT_DIR, str(output))
    proc = subprocess.run(["bash", "-e", "-c", command], env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout + proc.stderr
    return output


@pytest.mark.parametrize("path", _python_params())
def test_python_blocks_run(path, tmp_path, request):
    if any('"gemma3' in code for _, code in blocks(path, "python")):
        request.getfixturevalue("gemma3_dir")  # provisioned by `make test`; one clear error if it could not be
    code_blocks = []
    for line, code in blocks(path, "python"):
        for placeholder, replacement in PLACEHOLDERS.items():
            if placeholder in code:
                from optimum_ipex_spec.provisioning.provision import provision

                code = code.replace(placeholder, repr(str(provision(replacement))))
        if CLI_EXPORT_DIR in code:
            code = code.replace(CLI_EXPORT_DIR, str(request.getfixturevalue("cli_export_dir")))
        code_blocks.append({"file": path.relative_to(ROOT).as_posix(), "line": line, "code": code})
    (tmp_path / "blocks.json").write_text(json.dumps(code_blocks))
    (tmp_path / "runner.py").write_text(RUNNER)
    proc = subprocess.run([sys.executable, "runner.py", "blocks.json"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ALL BLOCKS PASSED" in proc.stdout, output[-6000:]


def _commands(code: str):
    lines = [line.split("#", 1)[0].strip() for line in code.splitlines()]
    return [line for line in lines if line]


def _bash_params():
    params = []
    for path in DOC_FILES:
        for line, code in blocks(path, "bash"):
            params.append(pytest.param(path, line, code, id=f"{path.relative_to(ROOT).as_posix()}:{line}"))
    return params


@pytest.mark.parametrize("path,line,code", _bash_params())
def test_bash_blocks_run(path, line, code, tmp_path):
    commands = _commands(code)
    unsafe = [c for c in commands if not any(p.fullmatch(c) for p in SAFE_BASH)]
    if unsafe:
        unknown = [c for c in unsafe if not any(c.startswith(prefix) for prefix in NOT_RUN_BASH)]
        if unknown and path.name in GENERATED:
            pytest.skip(f"not run here: commands in a generated page ({path.name}): {unknown}")
        assert not unknown, f"{path.name}:{line}: classify these commands in SAFE_BASH or NOT_RUN_BASH: {unknown}"
        reasons = sorted({NOT_RUN_BASH[max((p for p in NOT_RUN_BASH if c.startswith(p)), key=len)] for c in unsafe})
        pytest.skip("not run here: " + "; ".join(reasons))
    proc = subprocess.run(["bash", "-e", "-c", "\n".join(commands)], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_docs_fence_every_block_with_a_language():
    """Output and diagrams are ```text; an unlabelled fence would silently escape these tests."""
    for path in (ROOT / "docs").glob("*.md"):
        if path.name in GENERATED:
            continue
        labels = [m.group(2) for m in FENCE.finditer(path.read_text())]
        assert all(labels), f"{path.name}: fence every block (```python, ```bash or ```text)"


def _anchors(path: Path):
    """GitHub's heading anchors of ``path``: lower case, punctuation dropped, spaces -> '-'."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", path.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_docs_links_resolve():
    """Relative links and images of README.md and docs/*.md point at files (and headings) that exist."""
    for path in DOC_FILES:
        text = FENCE.sub("", path.read_text())
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            linked = (path.parent / target) if target else path
            assert linked.exists(), f"{path.name}: broken link {target}"
            if anchor and linked.suffix == ".md":
                assert anchor in _anchors(linked), f"{path.name}: no heading #{anchor} in {linked.name}"


def test_bench_render_rebuilds_report_and_plots(tmp_path):
    pytest.importorskip("matplotlib")  # pinned in the ipex28 and torch-current lanes
    out = tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--render",
                           str(ROOT / "docs" / "benchmarks.json"), "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = out.read_text()
    for png in ("benchmarks-throughput.png", "benchmarks-speedup-vs-k.png"):
        assert f"]({png})" in report
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for shown in ("Measured read bandwidth", "one-token roofline", "TTFT", "acceptance rate",
                  "tokens per target forward"):
        assert shown in report
    assert "import torch" not in (ROOT / "benchmarks" / "plots.py").read_text()
    committed = (ROOT / "docs" / "benchmarks.md").read_text()
    assert report == committed, "docs/benchmarks.md is stale: run bench.py --render docs/benchmarks.json --out docs/benchmarks.md"
