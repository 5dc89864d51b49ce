#!/usr/bin/env bash
# Run the fast tests under one torch release, in a fresh virtual environment:
#
#   tools/torch_matrix.sh 2.11.0            # any release from 2.11 on; extra pytest arguments follow
#   tools/torch_matrix.sh 2.15.0 -k torch_releases
#   PYTHON=python3.12 tools/torch_matrix.sh 2.15.0   # another interpreter
#
# The venv is $DIST_CKPT_MATRIX_DIR/pyX.Y-torch-VERSION (default /tmp/dist_ckpt_torch_matrix), made anew
# each run. torch is pinned through a constraints file of this script's own (PIP_CONSTRAINT), so
# that the project's extras (megatron-core, transformers, ...) cannot move it, and so that a
# machine-wide cap on torch (a pip.conf constraint) does not refuse a newer release. Releases other
# than the one a machine keeps on disk install as CUDA builds (about 4.6 GB) that run on the CPU.
# The last line printed is the summary: "torch VERSION, Python X.Y: <pytest's counts> (<seconds> s)".
set -euo pipefail
version="${1:?usage: tools/torch_matrix.sh TORCH_VERSION [pytest arguments]}"
shift
root="$(cd "$(dirname "$0")/.." && pwd)"
matrix="${DIST_CKPT_MATRIX_DIR:-/tmp/dist_ckpt_torch_matrix}"
python="${PYTHON:-python3}"
pyver="$("${python}" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
venv="${matrix}/py${pyver}-torch-${version}"
mkdir -p "${matrix}"
rm -rf "${venv}"
"${python}" -m venv "${venv}"
constraints="${matrix}/constraints-py${pyver}-${version}.txt"
echo "torch==${version}" > "${constraints}"
export PIP_CONSTRAINT="${constraints}"
"${venv}/bin/pip" install -q "torch==${version}"
"${venv}/bin/pip" install -q -e "${root}[all]"
installed="$("${venv}/bin/python" -c 'import torch; print(torch.__version__)')"
case "${installed}" in
    "${version}"|"${version}+"*) ;;
    *) echo "asked for torch ${version}, the venv holds ${installed}" >&2; exit 1 ;;
esac
cd "${root}"
start=$(date +%s)
set +e
"${venv}/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider "$@" | tee "${matrix}/pytest-py${pyver}-${version}.log"
status=${PIPESTATUS[0]}
set -e
counts="$(tail -n 1 "${matrix}/pytest-py${pyver}-${version}.log" | sed -e 's/^=* *//' -e 's/ *=*$//')"
echo "torch ${installed}, Python ${pyver}: ${counts} ($(( $(date +%s) - start )) s)"
exit "${status}"
