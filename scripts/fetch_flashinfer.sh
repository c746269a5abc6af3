#!/usr/bin/env bash
# Fetches FlashInfer's headers (and the CCCL they are built against) for pdsim's CUDA attention
# backend: downloads the pinned wheel flashinfer-python==0.7.4 from PyPI, checks its sha256 and
# unpacks only flashinfer/data/include/** and flashinfer/data/cccl/** into
# .cache/flashinfer-0.7.4/ (git-ignored; never committed). cmake/FlashInfer.cmake looks there.
#
# Idempotent: a stamp file holding the wheel's sha256 marks a complete unpack; with it present
# nothing is downloaded. Needs curl (or wget) and python3 (json, zipfile, hashlib).
#
# Environment:
#   PDSIM_FLASHINFER_DIR    where to unpack (default: <repo>/.cache/flashinfer-0.7.4)
#   PDSIM_FLASHINFER_WHEEL  a local copy of the wheel to use instead of downloading (for offline
#                           machines); it must have the pinned sha256 too
set -euo pipefail

VERSION="0.7.4"
WHEEL="flashinfer_python-${VERSION}-py3-none-any.whl"
SHA256="a051a62e09a2738e8b0de47a1944fd2f0f3eff01b728b662141ea660cb09dd32"
# The file's address on PyPI (stable: it contains the file's hash). If it ever moves, the JSON
# API of the project names the current one.
PINNED_URL="https://files.pythonhosted.org/packages/7e/22/"
PINNED_URL+="c96155b9959c0fb37ce179c7b1053552c170ab875bbbfc75406c9024c36f/${WHEEL}"
JSON_URL="https://pypi.org/pypi/flashinfer-python/json"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${PDSIM_FLASHINFER_DIR:-$ROOT/.cache/flashinfer-${VERSION}}"
STAMP="$DEST/.pdsim-fetched"

say() { echo "fetch_flashinfer: $*"; }
die() { echo "fetch_flashinfer: error: $*" >&2; exit 1; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SHA256" ] &&
   [ -f "$DEST/include/flashinfer/attention/prefill.cuh" ]; then
  say "FlashInfer $VERSION already in $DEST"
  exit 0
fi

command -v python3 >/dev/null 2>&1 ||
  die "python3 is needed (to read the PyPI index and unzip the wheel)"

fetch() {  # fetch URL FILE
  if command -v curl >/dev/null 2>&1; then
    local progress=(-sS)
    [ -t 2 ] && progress=(--progress-bar)  # a progress bar on a terminal, quiet in CI logs
    curl -fL --retry 3 --connect-timeout 30 "${progress[@]}" -o "$2" "$1"
  elif command -v wget >/dev/null 2>&1; then
    wget -q --tries=3 --timeout=30 -O "$2" "$1"
  else
    die "curl or wget is needed to download $WHEEL"
  fi
}

sha256_of() {
  python3 -c 'import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
print(h.hexdigest())' "$1"
}

mkdir -p "$(dirname "$DEST")"
TMP="$(mktemp -d "$(dirname "$DEST")/.flashinfer-fetch.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

if [ -n "${PDSIM_FLASHINFER_WHEEL:-}" ]; then
  [ -f "$PDSIM_FLASHINFER_WHEEL" ] ||
    die "PDSIM_FLASHINFER_WHEEL=$PDSIM_FLASHINFER_WHEEL: no such file"
  say "using the local wheel $PDSIM_FLASHINFER_WHEEL"
  wheel_path="$PDSIM_FLASHINFER_WHEEL"
else
  wheel_path="$TMP/$WHEEL"
  say "downloading $WHEEL (about 100 MB) from PyPI"
  if ! fetch "$PINNED_URL" "$wheel_path"; then
    say "the pinned address failed; asking the PyPI JSON API ($JSON_URL) for the file's address"
    fetch "$JSON_URL" "$TMP/index.json" ||
      die "cannot reach PyPI ($JSON_URL); download $WHEEL by hand and rerun with" \
          "PDSIM_FLASHINFER_WHEEL=<path>"
    url="$(python3 - "$TMP/index.json" "$JSON_URL" "$VERSION" "$WHEEL" <<'EOF'
import json, sys
from urllib.parse import urljoin
index, base, version, wheel = sys.argv[1:5]
with open(index) as f:
    files = json.load(f).get("releases", {}).get(version, [])
urls = [urljoin(base, f["url"]) for f in files if f.get("filename") == wheel]
print(urls[0] if urls else "")
EOF
)"
    [ -n "$url" ] || die "PyPI lists no $WHEEL for flashinfer-python $VERSION"
    fetch "$url" "$wheel_path" || die "downloading $url failed"
  fi
fi

got="$(sha256_of "$wheel_path")"
[ "$got" = "$SHA256" ] ||
  die "sha256 mismatch for $WHEEL: expected $SHA256, got $got (a corrupt or different file)"
say "sha256 ok; unpacking include/ and cccl/ into $DEST"

python3 - "$wheel_path" "$TMP/unpacked" <<'EOF'
import os, sys, zipfile
wheel, out = sys.argv[1:3]
prefixes = ("flashinfer/data/include/", "flashinfer/data/cccl/")
count = 0
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        name = info.filename
        if info.is_dir() or not name.startswith(prefixes):
            continue
        rel = name[len("flashinfer/data/"):]
        if rel.startswith("/") or ".." in rel.split("/"):
            sys.exit(f"unsafe path in the wheel: {name}")
        target = os.path.join(out, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with z.open(info) as src, open(target, "wb") as dst:
            dst.write(src.read())
        count += 1
if count == 0:
    sys.exit("the wheel holds no flashinfer/data/include or flashinfer/data/cccl files")
print(f"fetch_flashinfer: unpacked {count} files")
EOF

[ -f "$TMP/unpacked/include/flashinfer/attention/prefill.cuh" ] ||
  die "the wheel lacks include/flashinfer/attention/prefill.cuh"
[ -d "$TMP/unpacked/cccl/libcudacxx/include" ] || die "the wheel lacks cccl/libcudacxx/include"

rm -rf "$DEST"
mv "$TMP/unpacked" "$DEST"
echo "$SHA256" >"$STAMP"
say "FlashInfer $VERSION ready in $DEST"
