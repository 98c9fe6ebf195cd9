#!/usr/bin/env bash
# Builds the CPU image from the repository's Dockerfile with Debian 12's
# podman, on a machine with no container daemon and no Docker Hub: only the
# Debian mirror is needed. tests/deploy/image_test.py builds with it; it also
# serves anyone without Docker:
#
#   deploy/docker/podman-build.sh --state DIR [--tag NAME] [--jobs N] [--mirror URL]
#
# (as root; Debian packages podman and debootstrap, scripts/setup.sh installs
# them). Prints the image ID on its last line.
#
# - The base images the Dockerfile names (debian:12 and debian:12-slim,
#   read from its FROM lines) are made locally: debootstrap --variant=minbase
#   bookworm, with the official image's apt sources (bookworm,
#   bookworm-updates, bookworm-security), imported once and kept in DIR.
#   Delete DIR to remake them (newer packages).
# - Everything podman keeps lives in DIR: its containers.conf, storage.conf
#   and registries.conf (CONTAINERS_CONF, CONTAINERS_STORAGE_CONF,
#   CONTAINERS_REGISTRIES_CONF), images and layers, its CNI lock, temporary
#   files. No system configuration is changed, and the system's
#   containers.conf, storage.conf and registries.conf are not read; podman
#   4.3 still reads /etc/containers/policy.json and writes its blob-info
#   cache to /var/lib/containers/cache (128 KiB), which no setting moves.
# - What worked on the test machines: `--isolation chroot` (RUN steps
#   cannot create cgroups there), cgroupfs instead of systemd, and
#   `default_ulimits = []` with explicit `--ulimit`s, so that the build's
#   limits never depend on podman's defaults or the machine's (some of
#   these machines refused them; where they do not, the build's limits are
#   simply pinned). `--pull=never`: a missing base is an error here, not a
#   pull from Docker Hub. `--format docker` keeps the HEALTHCHECK: podman's
#   default OCI format drops it with a warning.
# - Layers are cached in DIR: a rerun with unchanged sources takes seconds;
#   images that a rebuild replaced are pruned.
set -euo pipefail

usage() {
  echo "usage: podman-build.sh --state DIR [--tag NAME] [--jobs N] [--mirror URL]" >&2
  exit 2
}

state= tag=localhost/plsh:cpu jobs=$(nproc) mirror=http://deb.debian.org
while [ $# -gt 0 ]; do
  case "$1" in
    --state) state=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --mirror) mirror=$2; shift 2 ;;
    *) usage ;;
  esac
done
[ -n "$state" ] || usage
repo=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$state"
state=$(cd "$state" && pwd)

if [ "$(id -u)" -ne 0 ]; then
  echo "podman-build.sh: needs root (debootstrap, and podman's rootful storage)" >&2
  exit 1
fi
for tool in podman debootstrap; do
  command -v "$tool" >/dev/null || { echo "podman-build.sh: $tool not found: run scripts/setup.sh" >&2; exit 1; }
done

# podman's configuration, all of it in $state.
mkdir -p "$state/storage" "$state/run" "$state/tmp" "$state/networks"
cat > "$state/containers.conf" <<EOF
# Written by deploy/docker/podman-build.sh.
[containers]
# podman's default nofile ulimit (1048576) is above these machines' limit.
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
events_logger = "none"
tmp_dir = "$state/run/libpod"
[network]
network_config_dir = "$state/networks"
EOF
cat > "$state/storage.conf" <<EOF
# Written by deploy/docker/podman-build.sh.
[storage]
driver = "overlay"
graphroot = "$state/storage"
runroot = "$state/run"
EOF
cat > "$state/registries.conf" <<'EOF'
# Written by deploy/docker/podman-build.sh: no registry is searched; the
# bases are local images.
unqualified-search-registries = []
EOF
export CONTAINERS_CONF=$state/containers.conf
export CONTAINERS_STORAGE_CONF=$state/storage.conf
export CONTAINERS_REGISTRIES_CONF=$state/registries.conf
export TMPDIR=$state/tmp

# The Debian bases the Dockerfile starts from. Only bookworm can be made
# here; another release in the Dockerfile is an error, not a wrong base.
mapfile -t bases < <(sed -n 's/^FROM[[:space:]]\{1,\}\(debian:[^[:space:]]*\).*/\1/p' "$repo/Dockerfile" | sort -u)
if [ ${#bases[@]} -eq 0 ]; then
  echo "podman-build.sh: the Dockerfile has no 'FROM debian:...' stage" >&2
  exit 1
fi
for base in "${bases[@]}"; do
  case "$base" in
    debian:12|debian:12-slim|debian:bookworm|debian:bookworm-slim) ;;
    *) echo "podman-build.sh: the Dockerfile asks for $base; this script makes Debian 12 (bookworm) bases only" >&2
       exit 1 ;;
  esac
done

missing=()
for base in "${bases[@]}"; do
  podman image exists "docker.io/library/$base" || missing+=("$base")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "podman-build.sh: making ${missing[*]} with debootstrap (minbase, bookworm, $mirror)" >&2
  rootfs=$state/base-rootfs
  rm -rf "$rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror/debian" > "$state/debootstrap.log" 2>&1 \
    || { tail -20 "$state/debootstrap.log" >&2; echo "podman-build.sh: debootstrap failed (log: $state/debootstrap.log)" >&2; exit 1; }
  # The official image's sources: security updates too, not bookworm alone.
  rm -f "$rootfs/etc/apt/sources.list"
  cat > "$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $mirror/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  id=$(tar --numeric-owner -C "$rootfs" -c . | podman import --change 'CMD ["bash"]' - "docker.io/library/${bases[0]}")
  for base in "${bases[@]}"; do
    podman tag "$id" "docker.io/library/$base"
  done
  rm -rf "$rootfs"
fi

# The CPU variant. BUILD_JOBS: the compile's parallelism. The build stage is
# tagged too (a first build up to it, then the whole one from the cache), so
# that pruning keeps its layers: the package install and the compile are
# what a rerun saves.
build=(podman build --isolation chroot --format docker --pull=never
       --ulimit nofile=1024:1024 --ulimit nproc=1024:1024
       --build-arg PLSH_VARIANT=cpu --build-arg BUILD_JOBS="$jobs" -f "$repo/Dockerfile")
"${build[@]}" --target build -t "$tag-build-stage" "$repo" >&2
"${build[@]}" --iidfile "$state/image-id" -t "$tag" "$repo" >&2
# Images that a rebuild replaced, with their layers; tagged ones stay.
podman image prune -f >/dev/null
cat "$state/image-id"
echo
