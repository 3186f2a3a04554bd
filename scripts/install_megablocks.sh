#!/usr/bin/env bash
# Build megablocks 0.10.0 and grouped_gemm 0.3.0 against the torch already installed, and install them.
#
# usage: scripts/install_megablocks.sh [--from DIR]
#   --from DIR   take the sdists from DIR (no network; scripts/gpu_check.sh --prepare DIR fetches them),
#                else download them from PyPI first
# environment: PYTHON (default python3), MAX_JOBS (default: all cores), TORCH_CUDA_ARCH_LIST
#
# Why a script: megablocks is source-only and pins torch 2.7.0, so a plain `pip install megablocks` would
# replace the user's torch. Here each package is built with --no-build-isolation --no-deps against the torch
# that is there (never replaced); csrc/cumsum.h is patched for CUDA 13 (scripts/patch_megablocks.py); and
# where no GPU is visible, TORCH_CUDA_ARCH_LIST (default "8.0;9.0": A100, H100/H200) tells the builds which
# GPUs to compile for instead of asking the absent device. stanford-stk is pure Python.
set -euo pipefail
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
FROM=""

usage() { sed -n '4,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --from) [[ $# -ge 2 ]] || { echo "install_megablocks: --from needs a folder" >&2; exit 2; }
                FROM=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install_megablocks: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done

if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    echo "install_megablocks: $PYTHON has no torch; set PYTHON to the interpreter whose torch megablocks should use" >&2
    exit 2
fi
cuda=$("$PYTHON" -c 'import torch; print(torch.version.cuda or "")')
if [[ -z "$cuda" ]]; then
    echo "install_megablocks: this torch ($("$PYTHON" -c 'import torch; print(torch.__version__)')) is a CPU build;" \
         "megablocks and grouped_gemm are CUDA extensions: run this on a machine with a CUDA build of torch" >&2
    exit 2
fi
if ! command -v nvcc >/dev/null && [[ -z "${CUDA_HOME:-}" ]]; then
    echo "install_megablocks: no CUDA compiler (nvcc not on PATH, CUDA_HOME unset); install the CUDA $cuda toolkit" >&2
    exit 2
fi
if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-"8.0;9.0"}
    echo "install_megablocks: no GPU visible; compiling for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [[ -z "$FROM" ]]; then
    FROM="$work/sdists"
    "$PYTHON" "$HERE/fetch_sdists.py" "$FROM"
fi
sdist() {  # the one sdist of $1 (a file-name prefix) in $FROM
    local found=("$FROM"/$1-*.tar.gz)
    [[ -f "${found[0]}" ]] || { echo "install_megablocks: no $1-*.tar.gz in $FROM" >&2; exit 2; }
    echo "${found[0]}"
}
pip_build() { "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index --no-cache-dir "$@"; }

torch_before=$("$PYTHON" -c 'import torch; print(torch.__version__)')
echo "install_megablocks: building against torch $torch_before (CUDA $cuda), MAX_JOBS=$MAX_JOBS"
pip_build "$(sdist "stanford[-_]stk")"
pip_build "$(sdist grouped_gemm)"
tar -xzf "$(sdist megablocks)" -C "$work"
"$PYTHON" "$HERE/patch_megablocks.py" "$work"/megablocks-*/
pip_build "$work"/megablocks-*/

torch_after=$("$PYTHON" -c 'import torch; print(torch.__version__)')
[[ "$torch_after" == "$torch_before" ]] || { echo "install_megablocks: torch changed ($torch_before -> $torch_after)" >&2; exit 1; }
"$PYTHON" -c 'import grouped_gemm.ops, megablocks, megablocks_ops
from importlib.metadata import version
print("install_megablocks: megablocks", version("megablocks"), "and grouped_gemm", version("grouped_gemm"), "import")'
