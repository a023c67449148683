#!/usr/bin/env bash
# Builds Prometheus (github.com/prometheus/prometheus/cmd/prometheus, for
# `dtjob devcluster up --prometheus`) from the Go module proxy and caches it per version:
#   $DTJOB_CACHE/bin/prometheus-v<V>/prometheus
# The module is built inside its own download, with its own go.mod and go.sum (`go install
# ...@v<V>` refuses modules whose go.mod has replace directives). Without the builtinassets tag
# the web UI is not embedded: the HTTP API (/api/v1/*) that the tests and Grafana use is.
# Service discovery: Kubernetes only (tags remove_all_sd,enable_kubernetes_sd; file and HTTP SD
# are always in). All 27 mechanisms pull in the cloud SDKs (AWS EC2, Azure compute, OCI, ...):
# a cold build of those had not finished after 17 minutes on this busy 2-core machine.
# Only the clusters that ask for Prometheus need it, so it is not part of build-binaries.sh's
# default set; a cached Prometheus is not rebuilt. Prints the bin directory on the last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=/dev/null
. "$here/versions.env"
cache=${DTJOB_CACHE:-$HOME/.cache/dtjob}
# GOWORK=off: the module ships a go.work naming sibling modules that its download leaves out.
export GOTOOLCHAIN=local CGO_ENABLED=0 GOWORK=off
command -v go >/dev/null || { echo "devcluster: the Go toolchain is missing; install Go >= 1.26 and retry" >&2; exit 1; }

prom_bin=$cache/bin/prometheus-v$PROMETHEUS_VERSION

build_prometheus() {
  local v=v$PROMETHEUS_VERSION dir tmp
  mkdir -p "$prom_bin"
  # `go mod download` needs a module to run in when GOFLAGS asks for -mod=mod; an empty one.
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  printf 'module dtjob.local/prometheusbuild\ngo 1.26.0\n' > "$tmp/go.mod"
  dir=$(cd "$tmp" && GOFLAGS= go mod download -json "github.com/prometheus/prometheus@$v" \
    | sed -n 's/^\s*"Dir": "\(.*\)",\?$/\1/p')
  [ -d "$dir" ] || { echo "devcluster: prometheus $v: the module download has no directory" >&2; exit 1; }
  echo "devcluster: building prometheus $v" >&2
  local pkg=github.com/prometheus/common/version
  # The release's own number (module v0.316.0 is Prometheus 3.16.0), from the module's VERSION file.
  local ld="-s -w -X $pkg.Version=$(cat "$dir/VERSION") -X $pkg.Revision=$v -X $pkg.Branch=release"
  ld="$ld -X $pkg.BuildUser=dtjob -X $pkg.BuildDate=19700101-00:00:00"
  local tags=remove_all_sd,enable_kubernetes_sd
  # -mod=readonly: the module cache is read-only, and its go.sum already lists every dependency.
  (cd "$dir" && GOFLAGS=-mod=readonly go build -trimpath -tags "$tags" -ldflags "$ld" -o "$prom_bin/prometheus.tmp" ./cmd/prometheus)
  mv "$prom_bin/prometheus.tmp" "$prom_bin/prometheus"
}

# One Prometheus build at a time per cache.
mkdir -p "$cache"
exec 9>"$cache/build-prometheus.lock"
flock 9
if [ ! -x "$prom_bin/prometheus" ]; then build_prometheus; fi
echo "$prom_bin"
