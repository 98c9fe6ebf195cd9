#!/usr/bin/env bash
# Validates deploy/compose/compose.replicas.yaml (three CPU replicas for a
# local try of sharding) on top of compose.yaml with docker-compose's own
# schema, without a Docker engine: the replicas join the cpu profile only,
# publish distinct loopback ports (50051-50053, metrics 9464-9466), and set
# only variables that compose.yaml's plsh-cpu sets too (so a renamed server
# setting, which tests/deploy/check_server_settings.py catches there, is
# caught here as well). As in compose_config.sh, the top-level `name:` that
# docker-compose 1.29 predates is dropped from a copy beside the original.
set -euo pipefail
compose_bin=$1
dir=$2
copy=$(mktemp "$dir/.compose-replicas-check-XXXXXX.yaml")
trap 'rm -f "$copy"' EXIT
grep -v '^name:' "$dir/compose.yaml" > "$copy"
fail() { echo "compose.replicas.yaml: $*" >&2; exit 1; }

services=$("$compose_bin" -f "$copy" -f "$dir/compose.replicas.yaml" --profile cpu config --services | sort | tr '\n' ' ')
[ "$services" = "grafana plsh plsh-cpu plsh-cpu-2 plsh-cpu-3 prometheus " ] || fail "services: got '$services'"
cpu=$("$compose_bin" -f "$copy" -f "$dir/compose.replicas.yaml" --profile cpu config)
for port in 50052:50051 50053:50051 9465:9464 9466:9464; do
  [ "$(grep -c -- "- 127.0.0.1:$port/tcp" <<<"$cpu")" = 1 ] || fail "port 127.0.0.1:$port is not published exactly once"
done
for svc in plsh-cpu-2 plsh-cpu-3; do  # plsh-cpu keeps 50051 and 9464
  ! sed -n "/^  $svc:\$/,/^  [a-z]/p" <<<"$cpu" | grep -qE -- "- 127.0.0.1:(50051|9464):" || fail "$svc publishes plsh-cpu's ports"
done
# Replica variables: a subset of plsh-cpu's.
base=$(sed -n '/^  plsh-cpu:$/,/^  [a-z]/p' <<<"$cpu" | grep -oE '^      PLSH_[A-Z_]+' | sort -u)
for svc in plsh-cpu-2 plsh-cpu-3; do
  vars=$(sed -n "/^  $svc:\$/,/^  [a-z]/p" <<<"$cpu" | grep -oE '^      PLSH_[A-Z_]+' | sort -u)
  [ -n "$vars" ] || fail "$svc sets no PLSH_* variable"
  extra=$(comm -23 <(echo "$vars") <(echo "$base"))
  [ -z "$extra" ] || fail "$svc sets variables plsh-cpu does not: $extra"
done
# The gpu profile is untouched: the replicas are CPU ones.
gpu=$("$compose_bin" -f "$copy" -f "$dir/compose.replicas.yaml" --profile gpu config)
grep -q "^  plsh:" <<<"$gpu" || fail "profile gpu lost its plsh service"
echo "compose.replicas.yaml: valid over compose.yaml ($services)"
