#!/usr/bin/env bash
# Builds KWOK (sigs.k8s.io/kwok/cmd/kwok, simulated nodes for `dtjob devcluster up --fake-nodes`)
# from the Go module proxy and caches it per version, with the module's own stage definitions:
#   $DTJOB_CACHE/bin/kwok-v<V>-p<KWOK_PATCH>/kwok
#   $DTJOB_CACHE/bin/kwok-v<V>-p<KWOK_PATCH>/stages/{node-initialize,node-heartbeat-with-lease,pod-ready,pod-complete,pod-delete}.yaml
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

kwok_bin=$cache/bin/kwok-v$KWOK_VERSION-p$KWOK_PATCH
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
  dir=$(cd "$mod" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
  # The patch (KWOK_PATCH=1): KWOK deletes a pod by name only, so a delete it retries or plays
  # late for a pod that is already gone removes the next pod of that name, which the operator
  # creates for the next generation as soon as the old one is gone (seen at 256 workers: new
  # workers deleted within seconds, the gang restarting again and again). Its pod deletes carry
  # the pod's UID as a precondition, as the kubelet's do. The module is built from a patched copy
  # (a replace directive; go build -overlay may not replace files of the module cache).
  local copy=$mod/kwok-src
  rm -rf "$copy" && cp -r "$dir" "$copy" && chmod -R u+w "$copy"
  local file=$copy/pkg/kwok/controllers/pod_controller.go
  sed -i 's/Delete(ctx, pod.Name, deleteOpt)/Delete(ctx, pod.Name, deleteThisPod(pod))/' "$file"
  [ "$(grep -c 'deleteThisPod(pod)' "$file")" = 1 ] || { echo "devcluster: kwok $v: the delete to patch is not in $file" >&2; exit 1; }
  cat >> "$file" <<'GO'

// deleteThisPod: deleteOpt with the pod's UID as a precondition (added by dtjob's build-kwok.sh).
func deleteThisPod(pod *corev1.Pod) metav1.DeleteOptions {
	opt := deleteOpt
	opt.Preconditions = metav1.NewUIDPreconditions(string(pod.UID))
	return opt
}
GO
  (cd "$mod" && go mod edit -replace "sigs.k8s.io/kwok=./kwok-src" && go mod tidy)
  echo "devcluster: building kwok $v (patch $KWOK_PATCH)" >&2
  # KWOK's version (pkg/consts.Version) is a constant of the module, so no -X stamp is needed.
  (cd "$mod" && go build -trimpath -ldflags "-s -w" -o "$kwok_bin/kwok.tmp" sigs.k8s.io/kwok/cmd/kwok)
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
