#!/usr/bin/env bash
# Bazel for this workspace, offline: fetches the pinned Bazel binary once (npm package @bazel/bazel-linux_x64, version
# and sha256 below) into .bazel/, then runs it. Python targets run on .venv (./bootstrap.sh first). Usage:
#   tools/bazel/bazel.sh test //...          every test file pytest runs (about as long as pytest)
#   tools/bazel/bazel.sh build //...
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
version=2.1.0
sha256=14cb6958e46fd5130720c26ae0b7c98e181dcb8bd111b0bfb23c7b4744e3609a
url=https://registry.npmjs.org/@bazel/bazel-linux_x64/-/bazel-linux_x64-$version.tgz
bin=$root/.bazel/bazel-$version
if [ ! -x "$bin" ]; then
  mkdir -p "$root/.bazel"
  tgz=$root/.bazel/bazel-linux_x64-$version.tgz
  if [ ! -f "$tgz" ]; then
    echo "fetching Bazel $version ($url)" >&2
    python3 -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" "$url" "$tgz.part"
    mv "$tgz.part" "$tgz"
  fi
  echo "$sha256  $tgz" | sha256sum -c --quiet - || { echo "bazel.sh: checksum mismatch for $tgz" >&2; rm -f "$tgz"; exit 1; }
  tar -xzf "$tgz" -C "$root/.bazel" package/bazel-$version-linux-x86_64
  mv "$root/.bazel/package/bazel-$version-linux-x86_64" "$bin"
  rmdir "$root/.bazel/package"
  chmod +x "$bin"
fi
if [ ! -x "$root/.venv/bin/python" ]; then
  echo "bazel.sh: no .venv: run ./bootstrap.sh first (Bazel's Python targets run on it)" >&2
  exit 1
fi
cd "$root"
exec "$bin" "$@"
