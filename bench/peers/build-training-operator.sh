#!/usr/bin/env bash
# Builds Kubeflow's training-operator from the Go module proxy and caches it per version, like the
# devcluster's binaries (devcluster/build-binaries.sh):
#   $DTJOB_CACHE/bin/training-operator-v<V>/training-operator
#   $DTJOB_CACHE/bin/training-operator-v<V>/crds/      the module's manifests/base/crds/
#   $DTJOB_CACHE/bin/training-operator-v<V>/webhook/   the module's manifests/base/webhook/
#   $DTJOB_CACHE/bin/training-operator-v<V>/rbac/      the module's manifests/base/rbac/
# Nothing is rebuilt when cached. Prints the bin directory on the last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=/dev/null
. "$here/versions.env"
cache=${DTJOB_CACHE:-$HOME/.cache/dtjob}
export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0
command -v go >/dev/null || { echo "bench-peers: the Go toolchain is missing; install Go >= 1.22 and retry" >&2; exit 1; }

v=v$TRAINING_OPERATOR_VERSION
bin=$cache/bin/training-operator-$v
mod=$cache/src/training-operator-$v
pkg=github.com/kubeflow/training-operator

build() {
  mkdir -p "$mod" "$bin"
  # A wrapper module: the operator's own go.mod (go 1.22, k8s.io/* v0.29.3) decides every
  # dependency through minimal version selection; nothing is replaced.
  printf 'module dtjob.local/trainingoperatorbuild\ngo 1.22\nrequire %s %s\n' "$pkg" "$v" > "$mod/go.mod"
  printf '//go:build tools\npackage tools\nimport _ "%s/cmd/training-operator.v1"\n' "$pkg" > "$mod/tools.go"
  (cd "$mod" && go mod tidy)
  echo "bench-peers: building training-operator $v" >&2
  (cd "$mod" && go build -trimpath -ldflags "-s -w" -o "$bin/training-operator.tmp" "$pkg/cmd/training-operator.v1")
  local src
  src=$(cd "$mod" && go list -m -f '{{.Dir}}' "$pkg")
  for d in crds webhook rbac; do
    rm -rf "${bin:?}/$d"
    cp -r "$src/manifests/base/$d" "$bin/$d"
    chmod -R u+w "$bin/$d"
  done
  mv "$bin/training-operator.tmp" "$bin/training-operator"
}

mkdir -p "$cache"
exec 9>"$cache/build-training-operator.lock"
flock 9
[ -x "$bin/training-operator" ] && [ -d "$bin/rbac" ] || build
echo "$bin"
