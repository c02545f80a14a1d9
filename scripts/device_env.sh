# Sourced by the device-machine scripts: packages the GPU image lacks (carried as wheels in the
# git-ignored .whl/), PYTHONPATH, and $OUT / session.log.
OUT=${OUT:-out}
mkdir -p "$OUT"
LOG="$OUT/session.log"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
elif [ -d /tmp/site ]; then  # a warm machine keeps what an earlier call installed
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
