#!/usr/bin/env bash
# Create (or reuse) the tools environment and print its path: nox (requirements/tools.txt), which
# runs the version matrix (noxfile.py, `make matrix`). Needs only python3 and the package index.
#   scripts/ensure-tools.sh  -> $OIS_VENV_ROOT/tools-<sha of requirements/tools.txt>
# Small (a few MB); the lanes' own environments are built by scripts/ensure-venv.sh LANE.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
req="$here/requirements/tools.txt"
root=${OIS_VENV_ROOT:-$HOME/.cache/optimum-ipex-spec/venvs}
stamp=$(sha256sum < "$req" | cut -c1-12)
venv="$root/tools-$stamp"
if [ -x "$venv/bin/nox" ] && [ "$(cat "$venv/.ois-stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "$venv"; exit 0
fi
echo "building the tools environment (nox) in $venv" >&2
quiet_pip() { grep -v "is ignored: it is neither a file nor a directory" || true; }
rm -rf "$venv"
mkdir -p "$root"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip 2>&1 | quiet_pip >&2
"$venv/bin/pip" install -q -r "$req" 2>&1 | quiet_pip >&2
echo "$stamp" > "$venv/.ois-stamp"
ls -1dt "$root"/tools-* 2>/dev/null | tail -n +3 | xargs -r rm -rf
echo "$venv"
