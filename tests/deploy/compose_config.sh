#!/usr/bin/env bash
# Validates deploy/compose/compose.yaml with docker-compose's own schema and
# interpolation, for both profiles, without a Docker engine.
# Debian 12's docker-compose (1.29) predates the top-level `name:` key of the
# Compose Specification, so that one line is dropped from a copy placed
# beside the original (relative paths resolve the same). Everything else is
# checked as written.
set -euo pipefail
compose_bin=$1
compose_file=$2
dir=$(dirname "$compose_file")
copy=$(mktemp "$dir/.compose-check-XXXXXX.yaml")
trap 'rm -f "$copy"' EXIT
grep -v '^name:' "$compose_file" > "$copy"
grep -q '^name: plsh$' "$compose_file" || { echo "compose.yaml: expected 'name: plsh'" >&2; exit 1; }

for profile in gpu cpu; do
  out=$("$compose_bin" -f "$copy" --profile "$profile" config)
  # The services each profile promises, with the settings this file is for.
  for service in prometheus grafana; do
    grep -q "^  $service:" <<<"$out" || { echo "profile $profile: no service $service" >&2; exit 1; }
  done
done
quiet=$("$compose_bin" -f "$copy" config --services | sort | tr '\n' ' ')
[ "$quiet" = "grafana plsh plsh-cpu prometheus " ] || { echo "services: got '$quiet'" >&2; exit 1; }
echo "compose.yaml: valid for profiles gpu and cpu ($quiet)"
