#!/usr/bin/env bash
# Set up everything on a fresh machine (once), then run the given command in
# the project's virtual environment with a fast BLAS preloaded.
#   ./run.sh omnidraft generate "prompt"      ./run.sh pytest
set -euo pipefail
cd "$(dirname "$0")"
# OMNIDRAFT_LOWEST=1: a second environment holding the lowest versions pyproject.toml allows of
# each direct dependency (uv's lowest-direct resolution), where .ci/run runs the fast suite again.
VENV=.venv
[[ -n ${OMNIDRAFT_LOWEST:-} ]] && VENV=.venv-lowest

if [[ "$(uname)" == "Linux" ]] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
    if command -v apt-get >/dev/null; then
        SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
        echo "run.sh: installing OpenBLAS (libopenblas0-pthread)" >&2
        $SUDO apt-get install -y -q --no-install-recommends libopenblas0-pthread >/dev/null \
          || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q --no-install-recommends libopenblas0-pthread >/dev/null; }
    else
        echo "run.sh: no apt-get; install OpenBLAS yourself or MLX will be ~75x slower" >&2
    fi
fi

if [[ ! -x $VENV/bin/python ]]; then
    python3 -m venv $VENV
fi
STAMP=$VENV/.installed-$(cat pyproject.toml | sha256sum | cut -c1-16)
if [[ ! -f $STAMP ]]; then
    echo "run.sh: installing omnidraft-mlx into $VENV" >&2
    if [[ -n ${OMNIDRAFT_LOWEST:-} ]]; then
        $VENV/bin/pip install -q uv
        $VENV/bin/uv pip install -q --python $VENV/bin/python --resolution lowest-direct -e '.[test]'
    else
        $VENV/bin/pip install -q -e '.[test]'
    fi
    touch "$STAMP"
fi

if [[ "$(uname)" == "Linux" ]]; then
    BLAS=$(ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 2>/dev/null | head -1 || true)
    [[ -n "$BLAS" ]] && export LD_PRELOAD="$BLAS${LD_PRELOAD:+ $LD_PRELOAD}"
fi
export PATH="$PWD/$VENV/bin:$PATH"
exec "$@"
