#!/usr/bin/env bash
# Builds KWOK (sigs.k8s.io/kwok/cmd/kwok, simulated nodes for `dtjob devcluster up --fake-nodes`)
# from the Go module proxy and caches it per version, with the module's own stage definitions:
#   $DTJOB_CACHE/bin/kwok-v<W>/kwok
#   $DTJOB_CACHE/bin/kwok-v<W>/stages/{node-initialize,node-heartbeat-with-lease,pod-ready,pod-complete,pod-delete}.yaml
# Only the clusters that ask for simulated nodes need it (a cold build is about 7 minutes on 2 busy
# cores), so it is not part of build-binaries.sh's default set. A cached KWOK is not rebuilt.
# Prints the bin directory on the last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=/dev/null
. "$here/versions.env"
cache=${DTJOB_CACHE:-$HOME/.cache/dtjob}
export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0
command -v go >/dev/null || { echo "devcluster: the Go toolchain is missing; install Go >= 1.26 and retry" >&2; exit 1; }

kwok_bin=$cache/bin/kwok-v$KWOK_VERSION
# The stages `up` passes with --config: nodes turn Ready at once and keep their lease (KWOK renews
# it; the plain heartbeat stage waits 20-45 s between beats, longer than the devcluster's 20 s
# node-monitor grace period), pods bound to a simulated node go Running at once and are removed
# when deleted.
stages=(node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease
        pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete)

build_kwok() {
  local mod=$cache/src/kwok-v$KWOK_VERSION v=v$KWOK_VERSION dir
  mkdir -p "$mod" "$kwok_bin"
  printf 'module dtjob.local/kwokbuild\ngo 1.26.0\nrequire sigs.k8s.io/kwok %s\n' "$v" > "$mod/go.mod"
  printf '//go:build tools\npackage tools\nimport _ "sigs.k8s.io/kwok/cmd/kwok"\n' > "$mod/tools.go"
  (cd "$mod" && go mod tidy)
  echo "devcluster: building kwok $v" >&2
  # KWOK's version (pkg/consts.Version) is a constant of the module, so no -X stamp is needed.
  (cd "$mod" && go build -trimpath -ldflags "-s -w" -o "$kwok_bin/kwok.tmp" sigs.k8s.io/kwok/cmd/kwok)
  dir=$(cd "$mod" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
  rm -rf "$kwok_bin/stages.tmp" && mkdir -p "$kwok_bin/stages.tmp"
  local s
  for s in "${stages[@]}"; do cp "$dir/kustomize/stage/$s.yaml" "$kwok_bin/stages.tmp/"; done
  chmod -R u+w "$kwok_bin/stages.tmp"
  rm -rf "$kwok_bin/stages" && mv "$kwok_bin/stages.tmp" "$kwok_bin/stages"
  mv "$kwok_bin/kwok.tmp" "$kwok_bin/kwok"
}

# One KWOK build at a time per cache (a lock of its own: it never waits for a Kubernetes build).
mkdir -p "$cache"
exec 9>"$cache/build-kwok.lock"
flock 9
if [ ! -x "$kwok_bin/kwok" ] || [ ! -d "$kwok_bin/stages" ]; then build_kwok; fi
echo "$kwok_bin"
