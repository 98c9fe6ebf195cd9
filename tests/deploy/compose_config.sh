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
secrets=$(mktemp -d)
trap 'rm -f "$copy"; rm -rf "$secrets"' EXIT
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

# The trust overlays (TLS and tokens, then client certificates) on top, with
# the secret files they name present (empty: the schema is what is checked;
# tests/deploy/check_chart_trust.py starts the server with real ones).
touch "$secrets/tls.crt" "$secrets/tls.key" "$secrets/tokens.json" "$secrets/client-ca.crt"
for overlays in "compose.trust.yaml" "compose.trust.yaml compose.mtls.yaml"; do
  files=(-f "$copy")
  for o in $overlays; do files+=(-f "$dir/$o"); done
  for profile in gpu cpu; do
    out=$(PLSH_SECRETS_DIR="$secrets" "$compose_bin" "${files[@]}" --profile "$profile" config)
    for want in "PLSH_TLS_CERT: /run/secrets/plsh_tls_cert" "PLSH_TOKEN_FILE: /run/secrets/plsh_tokens" \
                "PLSH_HEALTH_LISTEN: 0.0.0.0:50052" "source: plsh_tokens" "file: $secrets/tls.key"; do
      grep -qF "$want" <<<"$out" || { echo "$overlays, profile $profile: no '$want' in the merged config" >&2; exit 1; }
    done
    if [[ $overlays == *mtls* ]]; then
      grep -qF "PLSH_TLS_CLIENT_AUTH: require" <<<"$out" || { echo "$overlays: client certificates not required" >&2; exit 1; }
    fi
  done
done
echo "compose.trust.yaml, compose.mtls.yaml: valid overlays for profiles gpu and cpu"
