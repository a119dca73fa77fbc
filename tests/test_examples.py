"""Every script in examples/ runs to the end on the real models and says its output is the target's.

Each example exits with status 0 only when the speculative output is token-identical to the target
alone, and prints a line ``output: token-identical to the target alone``; the tokens/s lines are
checked for presence (their values depend on the machine). examples/demo.py (`make demo`) prints
``token-identical`` per prompt instead and is run with its smallest settings.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STRATEGY_SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_") and p.name != "demo.py")


@pytest.fixture
def ipex_lane():
    """The examples show the IPEX strategies (their docstrings run them in the ipex28 lane); in a lane
    without a usable IPEX they would only re-run the pure-PyTorch path at the same CI cost."""
    from optimum_ipex_spec.utils.import_utils import ipex_status

    status = ipex_status()
    if not status.available:
        pytest.skip(f"examples run in a lane with IPEX; here: {status.reason}")


def _run(args, timeout=600):
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_every_strategy_has_an_example():
    assert {"assisted_self_draft.py", "prompt_lookup.py", "universal_assisted.py",
            "custom_candidate_generator.py"} <= set(STRATEGY_SCRIPTS)


@pytest.mark.slow
@pytest.mark.parametrize("script", STRATEGY_SCRIPTS)
def test_example_runs_and_is_lossless(script, request, ipex_lane):
    if script == "universal_assisted.py":
        request.getfixturevalue("gemma3_dir")
    proc = _run([str(EXAMPLES / script)])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    lines = proc.stdout.splitlines()
    assert "output: token-identical to the target alone" in lines, output[-4000:]
    assert any(line.startswith("target alone:") and "tok/s" in line for line in lines), output[-4000:]
    assert any("tok/s" in line and "vs the target alone" in line for line in lines), output[-4000:]
    assert any(line.startswith("acceptance:") for line in lines), output[-4000:]


@pytest.mark.slow
def test_demo_runs(ipex_lane):
    proc = _run([str(EXAMPLES / "demo.py"), "--prompts", "1", "--max-new-tokens", "16"])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "backend=ipex" in proc.stdout or "backend=torch" in proc.stdout
    assert "median decode speedup over stock transformers" in proc.stdout
    spec = [line for line in proc.stdout.splitlines() if line.startswith("prompt 1:")]
    assert spec and spec[0].endswith("token-identical"), output[-4000:]
