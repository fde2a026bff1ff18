#!/usr/bin/env bash
# make compose-test: envoy/docker-compose.yaml, as it is, under a real Docker engine, offline.
#   1. installs what is missing (docker.io, docker-compose, mmdebstrap, curl; as root) and starts
#      dockerd when none answers (stopped again at the end);
#   2. makes the offline stand-ins of the public base images (tests/compose/standins.sh; kept);
#   3. builds the images with KVROUTE_BINARIES=prebuilt (the host's release binaries and filter,
#      which `make compose-test` builds first) and ups the stack under a project name of its own,
#      every host port on 127.0.0.1 chosen by Docker;
#      Envoy's admin must be off the network (it is read from inside the Envoy container);
#   4. sends a two-turn conversation through Envoy: the second turn must land on the first turn's
#      replica with x-kvroute-decision: precise;
#   5. kills indexd's container: requests must still be answered (fail open);
#   6. downs the project (containers, network, volume, its images) and removes the build cache
#      this run made.
# Prints "compose-test: N passed, N failed" and exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/../.."

started=$(date +%s)
compose_file=envoy/docker-compose.yaml
project="kvroute-test-$(date +%s)-$$"
scratch=$(mktemp -d -t kvroute-compose.XXXXXX)
dockerd_pid=
had_docker0=yes
compose=()
project_up=
main_done=
cache_before=
passed=0
failed=0

say() { printf '==> %s\n' "$*"; }
die() {
  printf 'compose-test: %s\n' "$*" >&2
  exit 1
}
check() { # check NAME CONDITION-EXIT-CODE...: count and print one assertion
  local name=$1
  shift
  if "$@"; then
    passed=$((passed + 1))
    printf 'ok   %s\n' "$name"
  else
    failed=$((failed + 1))
    printf 'FAIL %s\n' "$name"
  fi
}

cache_ids() {
  docker system df -v --format '{{range .BuildCache}}{{println .ID}}{{end}}' 2>/dev/null | sort
}

teardown_done=
teardown() { # idempotent; counts leftovers as failures
  [ -z "$teardown_done" ] || return 0
  teardown_done=yes
  set +e
  if [ -n "$project_up" ]; then
    if [ "$failed" -ne 0 ] || [ -z "$main_done" ]; then
      say "logs of $project (last 40 lines per service)"
      timeout 60 "${compose[@]}" logs --no-color --tail 40
    fi
    say "down: $project (containers, network, volume, images)"
    timeout 120 "${compose[@]}" down --volumes --rmi local --timeout 10
    local left
    left=$(docker ps -aq --filter "label=com.docker.compose.project=$project"
      docker network ls -q --filter "label=com.docker.compose.project=$project"
      docker volume ls -q --filter "label=com.docker.compose.project=$project"
      docker images -q --filter "reference=${project}*")
    check "nothing of $project left (containers, networks, volumes, images)" [ -z "$left" ]
  fi
  if [ -n "$cache_before" ]; then
    # The build cache this run made (BuildKit's records; the kept images are not cache).
    # One id per prune (the engine takes one value per filter); a record goes once the records
    # made from it have gone, hence a few passes.
    local new
    for _ in 1 2 3 4 5; do
      new=$(comm -13 <(printf '%s\n' "$cache_before") <(cache_ids) | grep -v '^$')
      [ -n "$new" ] || break
      for id in $new; do
        timeout 60 docker builder prune --all --force --filter "id=$id" >/dev/null 2>&1
      done
    done
    new=$(comm -13 <(printf '%s\n' "$cache_before") <(cache_ids) | grep -v '^$')
    check "no build cache left from this run" [ -z "$new" ]
  fi
  if [ -n "$dockerd_pid" ]; then
    say "stopping the dockerd this run started (pid $dockerd_pid)"
    kill -TERM "$dockerd_pid" 2>/dev/null
    for _ in $(seq 1 60); do
      kill -0 "$dockerd_pid" 2>/dev/null || break
      sleep 0.5
    done
    if kill -0 "$dockerd_pid" 2>/dev/null; then
      kill -KILL "$dockerd_pid" 2>/dev/null
      printf 'compose-test: dockerd did not stop within 30 s; killed\n' >&2
    fi
    wait "$dockerd_pid" 2>/dev/null
    check "the dockerd this run started has stopped" [ -z "$(pgrep -x dockerd)" ]
    # Its default bridge, when it made it (a stopped engine leaves the link behind).
    if [ -z "$had_docker0" ] && ip link show docker0 >/dev/null 2>&1; then
      ip link delete docker0
    fi
  fi
  rm -rf "$scratch"
  set -e
}

summary() {
  printf 'compose-test: %d passed, %d failed\n' "$passed" "$failed"
  say "compose-test took $(($(date +%s) - started)) s"
}

on_exit() {
  local rc=$?
  teardown
  [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ] && failed=1
  summary
  [ "$failed" -eq 0 ] || exit 1
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# --- 1. packages and the engine -------------------------------------------------------------
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
command -v curl >/dev/null 2>&1 || missing+=(curl)
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" -eq 0 ] || die "missing ${missing[*]}: install them (apt-get install) or run as root"
  say "apt-get install ${missing[*]}"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
fi

if timeout 20 docker info >/dev/null 2>&1; then
  say "Docker engine: already running (left running)"
else
  if pgrep -x dockerd >/dev/null; then
    die "a dockerd runs but does not answer: see its log"
  fi
  [ "$(id -u)" -eq 0 ] || die "no Docker engine answers and starting dockerd needs root"
  had_docker0=
  if ip link show docker0 >/dev/null 2>&1; then had_docker0=yes; fi
  say "starting dockerd (log: $scratch/dockerd.log until the end of the run)"
  # Its own session: a Ctrl-C reaches this script, whose cleanup stops it in order.
  setsid dockerd >"$scratch/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 1 120); do
    timeout 5 docker info >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || { tail -20 "$scratch/dockerd.log" >&2; die "dockerd exited"; }
    sleep 0.5
  done
  timeout 5 docker info >/dev/null 2>&1 || { tail -20 "$scratch/dockerd.log" >&2; die "dockerd did not answer within 60 s"; }
fi

# Compose: `docker compose` (v2) when the CLI has it, else Debian's docker-compose 1.29, which
# builds through the docker CLI with BuildKit (the Dockerfile needs it). A docker CLI of 23 or
# later does BuildKit through its buildx plugin only; the docker.io package's 20.10 CLI has it
# built in.
if docker compose version >/dev/null 2>&1; then
  compose=(docker compose)
else
  compose=(docker-compose)
  export COMPOSE_DOCKER_CLI_BUILD=1 DOCKER_BUILDKIT=1
  cli_major() { "$1" --version 2>/dev/null | sed -n 's/^Docker version \([0-9]*\)\..*/\1/p'; }
  if ! docker buildx version >/dev/null 2>&1 && [ "$(cli_major docker)" -ge 23 ]; then
    native=
    for cli in /usr/bin/docker /bin/docker; do
      major=$(cli_major "$cli")
      if [ -n "$major" ] && [ "$major" -lt 23 ]; then
        native=$cli
        break
      fi
    done
    [ -n "$native" ] || die "docker $(cli_major docker) has no buildx plugin and no docker CLI < 23 is installed: install docker-buildx or docker compose v2"
    mkdir -p "$scratch/bin"
    ln -s "$native" "$scratch/bin/docker"
    export PATH="$scratch/bin:$PATH"
    say "builds go through $native (BuildKit built in)"
  fi
fi
compose+=(-p "$project" -f "$compose_file")
say "compose: ${compose[*]}"

# --- 2. base images -------------------------------------------------------------------------
bash tests/compose/standins.sh

# --- 3. build and up ------------------------------------------------------------------------
prebuilt_dir=${KVROUTE_PREBUILT_DIR:-release}
for f in "target/$prebuilt_dir/indexd" "target/$prebuilt_dir/mock-vllm" target/wasm32-wasip1/release/kvroute_filter.wasm; do
  [ -f "$f" ] || die "$f is missing: make compose-test builds it (with CARGO_TARGET_DIR unset)"
done
export KVROUTE_PREBUILT_DIR=$prebuilt_dir
export KVROUTE_BINARIES=prebuilt KVROUTE_PORT=0 KVROUTE_INDEXD_PORT=0
cache_before=$(cache_ids)
[ -n "$cache_before" ] || cache_before=none
say "build ($project)"
project_up=yes
timeout 600 "${compose[@]}" build
say "up"
timeout 300 "${compose[@]}" up -d

# Every service healthy (bounded: 90 s).
services=(vllm-0 vllm-1 indexd envoy)
ids=()
for s in "${services[@]}"; do ids+=("$("${compose[@]}" ps -q "$s")"); done
deadline=$(($(date +%s) + 90))
while :; do
  healthy=0
  for i in "${!services[@]}"; do
    status=$(docker inspect -f '{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}' "${ids[$i]}" 2>/dev/null || echo gone)
    case $status in
      running/healthy) healthy=$((healthy + 1)) ;;
      running/starting) ;;
      *) die "service ${services[$i]} is $status" ;;
    esac
  done
  [ "$healthy" -eq ${#services[@]} ] && break
  [ "$(date +%s)" -lt "$deadline" ] || break
  sleep 0.5
done
check "every service healthy (vllm-0, vllm-1, indexd, envoy)" [ "$healthy" -eq ${#services[@]} ]
[ "$healthy" -eq ${#services[@]} ] || die "services not healthy within 90 s"

port_of() { # SERVICE PORT → 127.0.0.1:N
  local a
  a=$("${compose[@]}" port "$1" "$2" | tail -n 1)
  case $a in 127.0.0.1:*) printf '%s' "$a" ;; *) die "$1:$2 is published on '$a', not on 127.0.0.1" ;; esac
}
gateway=$(port_of envoy 10000)
indexd_http=$(port_of indexd 9471)
say "Envoy: http://$gateway  indexd: http://$indexd_http"

# Envoy's admin (:9901) listens on its container's loopback only: published nowhere, and
# refused on the compose network where the listener (:10000) answers. The test reads it from
# inside the Envoy container.
admin_published=$("${compose[@]}" port envoy 9901 2>/dev/null | grep -c ':[1-9]' || true)
check "Envoy's admin is not published on the host" [ "$admin_published" -eq 0 ]
envoy_ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}' \
  "$("${compose[@]}" ps -q envoy)" | awk '{ print $1 }')
from_indexd() { # PORT: whether indexd's container can open a TCP connection to Envoy's PORT
  timeout 20 "${compose[@]}" exec -T indexd bash -c "exec 3<>/dev/tcp/$envoy_ip/$1" 2>/dev/null
}
check "Envoy's listener answers on the compose network ($envoy_ip:10000)" from_indexd 10000
admin_refused() { ! from_indexd 9901; }
check "Envoy's admin is refused on the compose network ($envoy_ip:9901)" admin_refused
envoy_admin() { # PATH → the body of Envoy's admin answer, asked from inside its container
  "${compose[@]}" exec -T envoy bash -c 'exec 3<>/dev/tcp/127.0.0.1/9901 &&
    printf "GET %s HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n" "$1" >&3 && cat <&3' _ "$1" |
    python3 -c '
import sys
raw = sys.stdin.buffer.read()
head, _, body = raw.partition(b"\r\n\r\n")
if b"transfer-encoding: chunked" in head.lower():  # the admin answers in chunks
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size.split(b";")[0] or b"0", 16)
        if n == 0:
            break
        out, body = out + rest[:n], rest[n + 2:]
    body = out
sys.stdout.buffer.write(body)'
}

# One identity for each replica: the addresses indexd resolved the service names to are the
# hosts Envoy's STRICT_DNS cluster holds (else an override would name no host and Envoy would
# fall back to least-request unseen).
envoy_hosts=$(envoy_admin /clusters |
  sed -n 's/^vllm::\([0-9.]*:[0-9]*\)::health_flags::.*/\1/p' | sort -u | paste -sd ' ')
indexd_hosts=$(curl -sS --max-time 5 "http://$indexd_http/metrics" |
  sed -n 's/^indexd_replica_healthy{endpoint="\([^"]*\)".*/\1/p' | sort -u | paste -sd ' ')
say "Envoy's vllm hosts: $envoy_hosts; indexd's replicas: $indexd_hosts"
two_equal() { [ "$(wc -w <<<"$1")" -eq 2 ] && [ "$1" = "$2" ]; }
check "indexd names the replicas by the addresses Envoy resolved" two_equal "$envoy_hosts" "$indexd_hosts"

# --- 4. a two-turn conversation through Envoy -----------------------------------------------
chat() { # chat NAME BODY-FILE → $scratch/NAME.{headers,body}; prints the HTTP status
  curl -sS --max-time 60 -o "$scratch/$1.body" -D "$scratch/$1.headers" -w '%{http_code}' \
    -H 'content-type: application/json' --data-binary "@$2" "http://$gateway/v1/chat/completions"
}
header() { # header NAME HEADER → its value in $scratch/NAME.headers
  sed -n "s/^$2: *\\([^[:space:]]*\\).*/\\1/Ip" "$scratch/$1.headers" | tail -n 1
}
stored_blocks() {
  curl -sS --max-time 5 "http://$indexd_http/metrics" |
    awk '/^indexd_blocks_total\{.*outcome="stored"/ { n += $NF } END { print n + 0 }'
}

python3 - "$scratch" <<'EOF'
import json, sys
d = sys.argv[1]
system = "You are the compose test's assistant. " + " ".join(
    f"Rule {i}: answer plainly, cite the file, keep the context." for i in range(40))
turn1 = [{"role": "system", "content": system},
         {"role": "user", "content": "What does the compose stack run?"}]
json.dump({"model": "mock-model", "messages": turn1, "max_tokens": 16}, open(f"{d}/turn1.json", "w"))
json.dump(turn1, open(f"{d}/turn1.messages", "w"))
EOF
status1=$(chat turn1 "$scratch/turn1.json")
replica1=$(header turn1 x-mock-vllm-replica)
say "turn 1: HTTP $status1, replica $replica1, decision $(header turn1 x-kvroute-decision)"
check "turn 1 answered" [ "$status1" = 200 ]

# Turn 1's blocks reach indexd as KV events: wait until it has stored them (bounded: 10 s).
for _ in $(seq 1 50); do
  [ "$(stored_blocks)" -gt 0 ] && break
  sleep 0.2
done
check "indexd stored turn 1's blocks from the replica's KV events" [ "$(stored_blocks)" -gt 0 ]

python3 - "$scratch" <<'EOF'
import json, sys
d = sys.argv[1]
messages = json.load(open(f"{d}/turn1.messages"))
answer = json.load(open(f"{d}/turn1.body"))["choices"][0]["message"]["content"]
messages += [{"role": "assistant", "content": answer},
             {"role": "user", "content": "And what happens when indexd is gone?"}]
json.dump({"model": "mock-model", "messages": messages, "max_tokens": 16}, open(f"{d}/turn2.json", "w"))
messages += [{"role": "assistant", "content": "Envoy routes alone."},
             {"role": "user", "content": "Show me."}]
json.dump({"model": "mock-model", "messages": messages, "max_tokens": 16}, open(f"{d}/turn3.json", "w"))
json.dump({"model": "mock-model", "max_tokens": 16, "messages": [
    {"role": "user", "content": "A new conversation, " + "word " * 200}]},
    open(f"{d}/other.json", "w"))
EOF
status2=$(chat turn2 "$scratch/turn2.json")
replica2=$(header turn2 x-mock-vllm-replica)
decision2=$(header turn2 x-kvroute-decision)
cached2=$(python3 -c 'import json,sys; u=json.load(open(sys.argv[1]))["usage"]; print((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "of", u["prompt_tokens"])' "$scratch/turn2.body" 2>/dev/null || echo '?')
say "turn 2: HTTP $status2, replica $replica2, decision $decision2, cached tokens $cached2"
check "turn 2 answered" [ "$status2" = 200 ]
same() { [ -n "$1" ] && [ "$1" = "$2" ]; }
check "turn 2 on turn 1's replica ($replica1)" same "$replica1" "$replica2"
check "turn 2 decision is precise" [ "$decision2" = precise ]

# --- 5. indexd killed: requests still served ------------------------------------------------
say "kill indexd"
timeout 60 "${compose[@]}" kill indexd >/dev/null
indexd_id=$("${compose[@]}" ps -q indexd)
for _ in $(seq 1 50); do
  [ "$(docker inspect -f '{{.State.Running}}' "$indexd_id")" = false ] && break
  sleep 0.2
done
check "indexd's container stopped" [ "$(docker inspect -f '{{.State.Running}}' "$indexd_id")" = false ]
served=0
routed=0
for i in 1 2 3 4; do
  case $i in 1 | 3) body=turn3 ;; *) body=other ;; esac
  s=$(chat "down$i" "$scratch/$body.json")
  d=$(header "down$i" x-kvroute-decision)
  say "indexd down, request $i ($body): HTTP $s, replica $(header "down$i" x-mock-vllm-replica), decision $d"
  [ "$s" = 200 ] && served=$((served + 1))
  [ "$d" = precise ] && routed=$((routed + 1))
done
check "4 of 4 requests served with indexd down" [ "$served" -eq 4 ]
check "none claims a precise decision without indexd" [ "$routed" -eq 0 ]

main_done=yes
teardown
