#!/usr/bin/env bash
# Builds the local cluster's binaries from the Go module proxy and caches them per version:
#   $DTJOB_CACHE/bin/k8s-v<K>/{kube-apiserver,kube-controller-manager,kube-scheduler,kubectl}
#   $DTJOB_CACHE/bin/etcd-v<E>/etcd      $DTJOB_CACHE/bin/helm-v<H>/helm
# With --volcano also Volcano's scheduler and controller manager, from its release source tarball
# (its module is not on the proxy; every module it needs is; see volcano_tarball below), with
# the tarball's CRDs and scheduler configuration beside them:
#   $DTJOB_CACHE/bin/volcano-v<V>/{vc-scheduler,vc-controller-manager,crd/,config/}
# A binary that is already cached is not rebuilt. Prints the bin directories on the last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
volcano=false
for arg in "$@"; do
  case $arg in
    --volcano) volcano=true ;;
    *) echo "usage: $0 [--volcano]" >&2; exit 2 ;;
  esac
done
# shellcheck source=/dev/null
. "$here/versions.env"
cache=${DTJOB_CACHE:-$HOME/.cache/dtjob}
export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0
command -v go >/dev/null || { echo "devcluster: the Go toolchain is missing; install Go >= 1.26 and retry" >&2; exit 1; }

k8s_bin=$cache/bin/k8s-v$KUBERNETES_VERSION
etcd_bin=$cache/bin/etcd-v$ETCD_VERSION
helm_bin=$cache/bin/helm-v$HELM_VERSION
volcano_bin=$cache/bin/volcano-v$VOLCANO_VERSION
k8s_tools=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
volcano_tools=(vc-scheduler vc-controller-manager)

missing() { local d=$1; shift; for b in "$@"; do [ -x "$d/$b" ] || return 0; done; return 1; }

build_k8s() {
  local mod=$cache/src/k8s-v$KUBERNETES_VERSION minor=${KUBERNETES_VERSION#1.}
  minor=${minor%%.*}
  mkdir -p "$mod" "$k8s_bin"
  # k8s.io/kubernetes replaces its staging modules with ./staging paths that only exist in its own
  # repository; a wrapper module pins each of them to the matching published v0.<minor>.<patch>.
  local staging
  staging=$(curl -fsS "https://proxy.golang.org/k8s.io/kubernetes/@v/v$KUBERNETES_VERSION.mod" 2>/dev/null \
    | sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p') || true
  if [ -z "$staging" ]; then
    staging=$(cd "$mod" && go mod download -json "k8s.io/kubernetes@v$KUBERNETES_VERSION" \
      | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p' | xargs sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p')
  fi
  {
    echo "module dtjob.local/k8sbuild"
    echo "go 1.26.0"
    echo "require k8s.io/kubernetes v$KUBERNETES_VERSION"
    for m in $staging; do echo "replace $m => $m v0.${KUBERNETES_VERSION#1.}"; done
  } > "$mod/go.mod"
  {
    echo "//go:build tools"
    echo "package tools"
    echo "import ("
    for t in "${k8s_tools[@]}"; do echo "  _ \"k8s.io/kubernetes/cmd/$t\""; done
    echo ")"
  } > "$mod/tools.go"
  (cd "$mod" && go mod tidy)
  local v=v$KUBERNETES_VERSION pkg=k8s.io/component-base/version
  local ld="-s -w -X $pkg.gitVersion=$v -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  ld="$ld -X $pkg.buildDate=1970-01-01T00:00:00Z -X k8s.io/client-go/pkg/version.gitVersion=$v"
  ld="$ld -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$minor"
  for t in "${k8s_tools[@]}"; do
    [ -x "$k8s_bin/$t" ] && continue
    echo "devcluster: building $t $v" >&2
    (cd "$mod" && go build -trimpath -ldflags "$ld" -o "$k8s_bin/$t.tmp" "k8s.io/kubernetes/cmd/$t")
    mv "$k8s_bin/$t.tmp" "$k8s_bin/$t"
  done
}

build_etcd() {
  local mod=$cache/src/etcd-v$ETCD_VERSION v=v$ETCD_VERSION
  mkdir -p "$mod" "$etcd_bin"
  # etcd's server module replaces its sibling modules with ../ paths: pin them to the same tag.
  {
    echo "module dtjob.local/etcdbuild"
    echo "go 1.26.0"
    echo "require go.etcd.io/etcd/server/v3 $v"
    for m in api/v3 client/pkg/v3 client/v3 pkg/v3; do echo "replace go.etcd.io/etcd/$m => go.etcd.io/etcd/$m $v"; done
  } > "$mod/go.mod"
  printf '//go:build tools\npackage tools\nimport _ "go.etcd.io/etcd/server/v3"\n' > "$mod/tools.go"
  (cd "$mod" && go mod tidy)
  echo "devcluster: building etcd $v" >&2
  (cd "$mod" && go build -trimpath -ldflags "-s -w" -o "$etcd_bin/etcd.tmp" go.etcd.io/etcd/server/v3)
  mv "$etcd_bin/etcd.tmp" "$etcd_bin/etcd"
}

build_helm() {
  local mod=$cache/src/helm-v$HELM_VERSION v=v$HELM_VERSION minor=${KUBERNETES_VERSION#1.}
  minor=${minor%%.*}
  mkdir -p "$mod" "$helm_bin"
  printf 'module dtjob.local/helmbuild\ngo 1.26.0\nrequire helm.sh/helm/v3 %s\n' "$v" > "$mod/go.mod"
  printf '//go:build tools\npackage tools\nimport _ "helm.sh/helm/v3/cmd/helm"\n' > "$mod/tools.go"
  (cd "$mod" && go mod tidy)
  local ld="-s -w -X helm.sh/helm/v3/internal/version.version=$v -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  ld="$ld -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor"
  ld="$ld -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$minor"
  echo "devcluster: building helm $v" >&2
  (cd "$mod" && go build -trimpath -ldflags "$ld" -o "$helm_bin/helm.tmp" helm.sh/helm/v3/cmd/helm)
  mv "$helm_bin/helm.tmp" "$helm_bin/helm"
}

# The tarball: $DTJOB_VOLCANO_TARBALL, else shared/fixtures/volcano/ beside the checkout (or the
# repository it was cloned from), else Volcano's upstream release (dtjob/devcluster/volcano_source.py).
volcano_tarball() {
  python3 "$here/dtjob/devcluster/volcano_source.py" "$VOLCANO_VERSION" "$(cd "$here/.." && pwd)" "$cache"
}

build_volcano() {
  local tarball src=$cache/src/volcano-v$VOLCANO_VERSION v=v$VOLCANO_VERSION
  tarball=$(volcano_tarball)
  rm -rf "$src" && mkdir -p "$src" "$volcano_bin"
  tar -xzf "$tarball" -C "$src" --strip-components=1
  local ld="-s -w -X volcano.sh/volcano/pkg/version.Version=$v -X volcano.sh/volcano/pkg/version.GitSHA=release-$v"
  ld="$ld -X volcano.sh/volcano/pkg/version.Built=1970-01-01T00:00:00Z"
  local tool
  for tool in "${volcano_tools[@]}"; do
    [ -x "$volcano_bin/$tool" ] && continue
    echo "devcluster: building $tool $v" >&2
    (cd "$src" && go build -trimpath -ldflags "$ld" -o "$volcano_bin/$tool.tmp" "./cmd/${tool#vc-}")
    mv "$volcano_bin/$tool.tmp" "$volcano_bin/$tool"
  done
  # What `up --volcano` installs and reads: the release's CRDs and scheduler configurations.
  rm -rf "$volcano_bin/crd" "$volcano_bin/config"
  cp -r "$src/installer/helm/chart/volcano/crd/bases" "$volcano_bin/crd"
  cp -r "$src/installer/helm/chart/volcano/config" "$volcano_bin/config"
}

# One build at a time per cache and project: a second caller waits here, then finds the binaries
# cached. Volcano has a lock of its own (other outputs; Go's caches are safe to share), so a
# Volcano build never waits for a Kubernetes build it does not need.
mkdir -p "$cache"
if missing "$etcd_bin" etcd || missing "$helm_bin" helm || missing "$k8s_bin" "${k8s_tools[@]}"; then
  exec 9>"$cache/build.lock"
  flock 9
  missing "$etcd_bin" etcd && build_etcd
  missing "$helm_bin" helm && build_helm
  missing "$k8s_bin" "${k8s_tools[@]}" && build_k8s
  exec 9>&-
fi
dirs="$k8s_bin:$etcd_bin:$helm_bin"
if $volcano; then
  exec 8>"$cache/build-volcano.lock"
  flock 8
  if missing "$volcano_bin" "${volcano_tools[@]}" || [ ! -d "$volcano_bin/crd" ]; then build_volcano; fi
  dirs="$dirs:$volcano_bin"
fi
echo "$dirs"
