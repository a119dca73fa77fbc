"""The version lanes and the version matrix (issue 6).

Each lane is one set of pins, ``requirements/<lane>.txt``, and one environment built by
``scripts/ensure-venv.sh LANE`` (named by the sha of its pins, reused): the same environment that
``make test LANE=<lane>`` uses. The nox sessions below run no virtualenv of their own
(``venv_backend="none"``); they call the lane's python.

    make matrix                          # every lane, full suite (real-model tests included)
    make matrix MARK="not slow"          # every lane, tiny-model tests only
    make matrix LANES="ipex27 tf453"     # some lanes
    $(scripts/ensure-tools.sh)/bin/nox -s ipex27 -- -k assisted   # one lane, extra pytest arguments

A lane session builds (or reuses) the environment, records the versions actually imported
(scripts/lane-info.py), runs pytest with a junit XML report, and merges the counts into
docs/version-matrix.json, from which docs/version-matrix.md is rendered. A lane that does not
install, or whose IPEX does not import, is recorded as such with the reason. The session fails
when its lane is not green, after the report is written.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
BUILD = ROOT / "build" / "matrix"
DOC = ROOT / "docs" / "version-matrix.md"
DATA = ROOT / "docs" / "version-matrix.json"

#: The lanes, in report order: name -> what the lane is for. Pins: requirements/<name>.txt.
LANES = {
    "ipex28": "IPEX 2.8 (the last IPEX release) with the transformers it validates; the default lane, run by CI",
    "ipex27": "IPEX 2.7 with the transformers it validates",
    "ipex26": "IPEX 2.6 with the transformers it validates (4.46.2; the package asks for >= 4.48)",
    "torch-current": "no IPEX: current torch (CPU wheel) and transformers 5.x; run by CI",
    "tf453": "no IPEX: transformers 4.53.3, the last release that crops caches with the module-level "
    "candidate_generator._crop_past_key_values",
}

nox.options.sessions = list(LANES)
nox.options.error_on_missing_interpreters = False


def pins(lane: str) -> dict:
    """``name -> version`` for the ``==`` pins of requirements/<lane>.txt."""
    out = {}
    for line in (ROOT / "requirements" / f"{lane}.txt").read_text().splitlines():
        match = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s#;]+)", line)
        if match:
            out[match.group(1).lower()] = match.group(2)
    return out


def _git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _install_reason(stderr: str, returncode: int) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and "is ignored: it is neither" not in line]
    errors = [line for line in lines if line.startswith("ERROR:")]
    picked = errors[:2] or lines[-2:] or [f"exit status {returncode}"]
    return " ".join(picked)[:400]


def _stream(cmd: list, log: Path, env: dict | None = None) -> int:
    """Run ``cmd`` in the repository root, echoing its output and writing it to ``log``."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        while True:  # chunks, not lines: pytest's progress dots show up as they come
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            out.write(chunk)
            out.flush()
        return proc.wait()


def _first_lines(node) -> str:
    """The gist of a failure: its message's first non-empty lines, else the traceback's ``E`` lines."""
    lines = [l.strip() for l in (node.get("message") or "").splitlines() if l.strip()]
    if len(" ".join(lines[:2])) < 40:  # e.g. a bare "AssertionError:" from an assert with a message
        lines += [l[1:].strip() for l in (node.text or "").splitlines() if l.startswith("E ") and l[1:].strip()]
    return " ".join(dict.fromkeys(lines[:3])).replace("|", "/")[:300] or "?"


def parse_junit(path: Path) -> dict:
    """Counts, skip reasons and failures from a pytest junit XML file (one verdict per test case)."""
    counts = Counter()
    skips = Counter()
    failures = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
        if failure is not None or error is not None:
            kind = "failed" if failure is not None else "errors"
            node = failure if failure is not None else error
            counts[kind] += 1
            failures.append({"test": test, "kind": kind, "message": _first_lines(node)})
        elif skipped is not None:
            counts["skipped"] += 1
            reason = (skipped.get("message") or "").strip() or "(no reason)"
            if skipped.get("type") == "pytest.xfail":
                reason = f"xfail: {reason}"
            skips[reason] += 1
        else:
            counts["passed"] += 1
    return {
        "passed": counts["passed"], "failed": counts["failed"], "skipped": counts["skipped"],
        "errors": counts["errors"], "total": sum(counts.values()),
        "skip_reasons": dict(skips.most_common()), "failures": failures,
    }


def _load() -> dict:
    if DATA.exists():
        return json.loads(DATA.read_text())
    return {"runs": {}}


def _save(record: dict) -> None:
    data = _load()
    data["runs"][f"{record['lane']} | {record['selection']}"] = record
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    render(data)


def _duration(seconds) -> str:
    if seconds is None:
        return ""
    seconds = int(round(seconds))
    return f"{seconds // 60}m {seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _ipex_cell(record: dict) -> str:
    info = record.get("versions") or {}
    if info.get("ipex"):
        return info["ipex"]
    if "intel-extension-for-pytorch" in record.get("pins", {}):
        return f"{record['pins']['intel-extension-for-pytorch']} pinned, not imported" if info else \
            record["pins"]["intel-extension-for-pytorch"] + " (pinned)"
    return "none"


def render(data: dict | None = None) -> None:
    """docs/version-matrix.md from docs/version-matrix.json."""
    data = data or _load()
    order = {lane: i for i, lane in enumerate(LANES)}
    runs = sorted(data["runs"].values(), key=lambda r: (order.get(r["lane"], 99), r["lane"],
                                                        r["selection"] != "full suite", r["selection"]))
    out = [
        "# Version matrix",
        "",
        "<!-- Generated by `make matrix` (noxfile.py) from docs/version-matrix.json: do not edit by hand. -->",
        "",
        "Each row is the latest run of one lane with one test selection, on the machine that ran it "
        "(see the date and the commit: `+changes` means uncommitted changes in the working tree). "
        "Versions are the ones the lane's environment actually imported; counts come from pytest's junit XML. "
        "Wall time is the test run alone (building the environment is not included).",
        "",
        "| lane | torch | IPEX | transformers | tests | passed | failed | skipped | errors | wall | date (UTC) | commit |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in runs:
        v = r.get("versions") or {}
        p = r.get("pins", {})
        if r["status"] != "ran":
            out.append(f"| `{r['lane']}` | {v.get('torch') or p.get('torch', '')} | {_ipex_cell(r)} | "
                       f"{v.get('transformers') or p.get('transformers', '')} | {r['status']}: "
                       f"{r['reason'].replace('|', '/')} | | | | | | {r['date']} | {r['commit']} |")
            continue
        out.append(f"| `{r['lane']}` | {v.get('torch')} | {_ipex_cell(r)} | {v.get('transformers')} | "
                   f"{r['selection']} | {r['passed']} | {r['failed']} | {r['skipped']} | {r['errors']} | "
                   f"{_duration(r['wall_s'])} | {r['date']} | {r['commit']} |")
    missing = [lane for lane in LANES if not any(r["lane"] == lane for r in runs)]
    if missing:
        out += ["", "Not run yet: " + ", ".join(f"`{lane}`" for lane in missing) + "."]
    out += ["", "## Lanes", ""]
    for lane, purpose in LANES.items():
        out += [f"### `{lane}`", "", f"{purpose}. Pins: `requirements/{lane}.txt`; "
                f"`make test LANE={lane}` runs its full suite, `make matrix LANES={lane}` records it here.", ""]
        for r in [r for r in runs if r["lane"] == lane]:
            v = r.get("versions") or {}
            out.append(f"**{r['selection']}** ({r['date']}, {r['commit']}): " + (
                f"{r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped, {r['errors']} errors "
                f"in {_duration(r['wall_s'])}." if r["status"] == "ran" else f"{r['status']}: {r['reason']}"))
            out.append("")
            if v:
                extra = ", ".join(f"{k} {v[k]}" for k in ("python", "tokenizers", "optimum") if v.get(k))
                cuda = f" (CUDA {v['torch_cuda_build']} build, run on the CPU)" if v.get("torch_cuda_build") else ""
                out.append(f"- imported: torch {v.get('torch')}{cuda}, transformers {v.get('transformers')}, "
                           f"IPEX {v.get('ipex') or 'none'}, {extra}")
                if v.get("ipex_error") and v["ipex_error"] != "not installed":
                    out.append(f"- IPEX import: {v['ipex_error']}")
                if "package_ipex_path" in v:
                    out.append("- `IPEXModelForCausalLM` path: " + (
                        "IPEX" if v["package_ipex_path"] else f"pure PyTorch ({v.get('package_ipex_reason')})"))
            if r.get("venv_s") is not None:
                out.append(f"- environment: `scripts/ensure-venv.sh {lane}` took {_duration(r['venv_s'])} "
                           f"({'built' if r['venv_s'] > 60 else 'reused'})")
            if r["status"] == "ran":
                out.append(f"- command: `{r['command']}` (exit status {r['exit']})")
            if r.get("skip_reasons"):
                out.append("- skip reasons:")
                out += [f"  - {n} x {reason.replace('|', '/')}" for reason, n in r["skip_reasons"].items()]
            if r.get("failures"):
                out.append("- failed / errors:")
                out += [f"  - `{f['test']}` ({f['kind']}): {f['message']}" for f in r["failures"][:60]]
                if len(r["failures"]) > 60:
                    out.append(f"  - ... {len(r['failures']) - 60} more in build/matrix/{lane}.xml")
            out.append("")
    DOC.write_text("\n".join(out).rstrip() + "\n")


def run_lane(session: nox.Session, lane: str) -> None:
    BUILD.mkdir(parents=True, exist_ok=True)
    mark = os.environ.get("OIS_MATRIX_MARK", "").strip()
    selection = f'-m "{mark}"' if mark else "full suite"
    if session.posargs:
        selection += " " + " ".join(session.posargs)
    record = {
        "lane": lane, "selection": selection, "pins": pins(lane), "commit": _git_revision(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }

    session.log(f"{lane}: scripts/ensure-venv.sh {lane} (a first build takes minutes)")
    start = time.monotonic()
    built = subprocess.run(["scripts/ensure-venv.sh", lane], cwd=ROOT, capture_output=True, text=True)
    record["venv_s"] = round(time.monotonic() - start, 1)
    sys.stderr.write(built.stderr)
    if built.returncode != 0:
        record.update(status="does not install", reason=_install_reason(built.stderr, built.returncode))
        _save(record)
        session.error(f"{lane} does not install: {record['reason']}")
    python = str(Path(built.stdout.strip().splitlines()[-1]) / "bin" / "python")

    probe = subprocess.run([python, "scripts/lane-info.py"], cwd=ROOT, capture_output=True, text=True)
    try:
        record["versions"] = json.loads(probe.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        record.update(status="does not import", reason=_install_reason(probe.stderr, probe.returncode))
        _save(record)
        session.error(f"{lane} does not import: {record['reason']}")
    versions = record["versions"]
    session.log(f"{lane}: " + json.dumps(versions))
    for module in ("torch", "transformers"):
        if not versions.get(module):
            record.update(status="does not import", reason=f"{module}: {versions.get(module + '_error')}")
            _save(record)
            session.error(f"{lane} does not import: {record['reason']}")
    if "intel-extension-for-pytorch" in record["pins"] and not versions.get("ipex"):
        record.update(status="does not import", reason=f"intel_extension_for_pytorch: {versions.get('ipex_error')}")
        _save(record)
        session.error(f"{lane}: IPEX does not import: {record['reason']}")

    xml = BUILD / f"{lane}.xml"
    xml.unlink(missing_ok=True)
    cmd = [python, "-m", "pytest", f"--junitxml={xml}"] + (["-m", mark] if mark else []) + list(session.posargs)
    record["command"] = " ".join(["pytest"] + ([f'-m "{mark}"'] if mark else []) + list(session.posargs))
    session.log(f"{lane}: {record['command']} (log: {(BUILD / f'{lane}.log').relative_to(ROOT)})")
    start = time.monotonic()
    code = _stream(cmd, BUILD / f"{lane}.log")
    record["wall_s"] = round(time.monotonic() - start, 1)
    record["exit"] = code
    if not xml.exists():
        record.update(status="pytest did not run", reason=f"exit status {code}, no junit XML (see build/matrix/{lane}.log)")
        _save(record)
        session.error(f"{lane}: {record['reason']}")
    record.update(status="ran", reason="", **parse_junit(xml))
    _save(record)
    summary = (f"{lane} ({selection}): {record['passed']} passed, {record['failed']} failed, "
               f"{record['skipped']} skipped, {record['errors']} errors in {_duration(record['wall_s'])}")
    if record["failed"] or record["errors"] or code not in (0, 5):
        session.error(summary)
    session.log(summary)


def _lane_session(lane: str):
    def session(session: nox.Session) -> None:
        run_lane(session, lane)

    session.__doc__ = f"Lane {lane}: {LANES[lane]}."
    return nox.session(name=lane, venv_backend="none")(session)


for _lane in LANES:
    globals()[f"lane_{_lane.replace('-', '_')}"] = _lane_session(_lane)


@nox.session(venv_backend="none")
def report(session: nox.Session) -> None:
    """Re-render docs/version-matrix.md from docs/version-matrix.json (no tests run)."""
    render()
    session.log(f"wrote {DOC.relative_to(ROOT)}")
