"""Print, as one JSON object, what a lane's environment actually imports (run with the lane's python).

    $(scripts/ensure-venv.sh ipex27)/bin/python scripts/lane-info.py

IPEX is imported in a child process: on a torch/IPEX version mismatch it prints an error and calls
exit() instead of raising. Used by noxfile.py for docs/version-matrix.md.
"""

import importlib
import importlib.metadata as md
import json
import platform
import subprocess
import sys


def installed(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def imported(module, dist=None):
    try:
        mod = importlib.import_module(module)
        return getattr(mod, "__version__", None) or installed(dist or module) or "?", None
    except Exception as exc:  # noqa: BLE001 - any import failure is a finding
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def ipex():
    if installed("intel-extension-for-pytorch") is None:
        return None, "not installed"
    code = "import intel_extension_for_pytorch as m; print('OIS-IPEX', m.__version__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("OIS-IPEX "):
            return line.split(" ", 1)[1], None
    lines = [l.strip() for l in (proc.stderr + proc.stdout).splitlines() if l.strip()]
    errors = [l for l in lines if "Error" in l or "ERROR" in l] or lines or [f"exit status {proc.returncode}"]
    return None, errors[-1][:300]


def main():
    info = {"python": platform.python_version()}
    for module in ("torch", "transformers", "tokenizers", "optimum"):
        version, error = imported(module)
        info[module] = version
        if error:
            info[f"{module}_error"] = error
    if info["torch"]:
        import torch

        info["torch_cuda_build"] = torch.version.cuda
    info["ipex_installed"] = installed("intel-extension-for-pytorch")
    info["ipex"], info["ipex_error"] = ipex()
    try:  # the package's own verdict (whether IPEXModelForCausalLM takes the IPEX path)
        from optimum_ipex_spec.utils.import_utils import ipex_status

        status = ipex_status()
        info["package_ipex_path"] = bool(status.available)
        info["package_ipex_reason"] = getattr(status, "reason", None)
    except Exception as exc:  # noqa: BLE001
        info["package_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    print(json.dumps(info))


if __name__ == "__main__":
    main()
