#!/usr/bin/env bash
# Build the offline CPU stand-in for the official PyTorch base image, with no
# registry: debootstrap a minimal Debian with python3, `docker import` it, then
# install torch (CPU) from a wheelhouse made on this host with `pip download`.
# Like the official image, `python3` on PATH (here /opt/venv/bin, there
# /opt/conda/bin) imports torch and has pip, setuptools and wheel.
#
#   docker/build-cpu-base.sh [IMAGE_TAG]          (default ddpk-base:cpu)
#
# The rootfs tarball and the wheelhouse are cached under .cache/cpu-base in the
# clone, so a rebuild here takes under a minute; delete that folder to start afresh.
# Environment: DDPK_DEBIAN_MIRROR (default: apt's configured Debian mirror),
# DDPK_TORCH_SPEC (default torch==2.13.0+cpu), DDPK_TORCH_INDEX (an extra index
# holding the +cpu wheel, e.g. the PyTorch CPU index, where no local copy exists),
# PYTHON (the host python whose pip downloads the wheels).
set -euo pipefail

image_tag=${1:-ddpk-base:cpu}
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${DDPK_CPU_BASE_CACHE:-$root/.cache/cpu-base}
suite=bookworm
# bookworm's python3 is 3.11: the wheelhouse is resolved for cp311.
py_version=3.11
# python3-venv brings ensurepip, so the image gets its own venv with pip in it.
packages=python3,python3-venv
torch_spec=${DDPK_TORCH_SPEC:-torch==2.13.0+cpu}
# pip/setuptools/wheel recent enough for PEP 517 builds without network
# (the trainer's build-system wants setuptools>=68).
tool_specs=("pip>=23.1" "setuptools>=68" "wheel")
# The official image ships numpy; without it torch warns at every import.
extra_specs=(numpy)
venv=/opt/venv

log() { printf '[build-cpu-base] %s\n' "$*" >&2; }

debian_mirror() {
  if [ -n "${DDPK_DEBIAN_MIRROR:-}" ]; then
    echo "$DDPK_DEBIAN_MIRROR"
    return
  fi
  local uri=""
  if [ -r /etc/apt/sources.list.d/debian.sources ]; then
    # deb822: the first URIs line that is not the security archive.
    uri=$(awk '/^URIs:/ && !/security/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$uri" ] && [ -r /etc/apt/sources.list ]; then
    uri=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' /etc/apt/sources.list)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

host_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3 "$root/.venv/bin/python"; do
    if [ -n "$candidate" ] && "$candidate" -m pip --version >/dev/null 2>&1; then
      echo "$candidate"
      return
    fi
  done
  log "no python with pip on this host (set PYTHON)"
  exit 1
}

# Removes what a runtime image never reads; run inside the rootfs and again
# after installs so the layers stay small.
slim_rootfs() {
  local dir=$1
  rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin \
    "$dir"/var/cache/apt/archives/*.deb "$dir"/var/cache/debconf/*-old \
    "$dir"/usr/share/doc/* "$dir"/usr/share/man/* "$dir"/usr/share/info/* \
    "$dir"/usr/share/locale/* "$dir"/usr/share/lintian "$dir"/var/log/*.log \
    "$dir"/var/log/apt/* "$dir"/root/.cache
}

# debootstrap mounts proc and sys (inside a container, the host's /dev too) in
# the target; an interrupted run leaves them mounted. Unmount them and never
# let rm cross into a mount, so a cleanup cannot reach the host's /dev.
remove_tree() {
  local dir=$1 mnt
  [ -e "$dir" ] || return 0
  while read -r mnt; do
    umount -l "$mnt" 2>/dev/null || true
  done < <(awk -v d="$dir/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r)
  rm -rf --one-file-system "$dir"
}

build_rootfs_tarball() {
  local tarball=$1 mirror work
  mirror=$(debian_mirror)
  work="$cache/rootfs.tmp"
  remove_tree "$work"
  mkdir -p "$work"
  log "debootstrap --variant=minbase $suite from $mirror (a few minutes, once)"
  debootstrap --variant=minbase --include="$packages" "$suite" "$work" "$mirror" >"$cache/debootstrap.log" 2>&1 || {
    tail -20 "$cache/debootstrap.log" >&2
    [ -r "$work/debootstrap/debootstrap.log" ] && tail -20 "$work/debootstrap/debootstrap.log" >&2
    exit 1
  }
  # Keep docs and locales out of anything apt-get installs later too.
  cat >"$work/etc/dpkg/dpkg.cfg.d/01-ddpk-nodoc" <<'EOF'
path-exclude /usr/share/doc/*
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
  slim_rootfs "$work"
  tar --numeric-owner -C "$work" -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  remove_tree "$work"
}

build_wheelhouse() {
  local wheels=$1 py
  py=$(host_python)
  local index_args=()
  if [ -n "${DDPK_TORCH_INDEX:-}" ]; then
    index_args=(--extra-index-url "$DDPK_TORCH_INDEX")
  fi
  log "pip download $torch_spec ${tool_specs[*]} ${extra_specs[*]} for cp${py_version/./} into $wheels"
  rm -rf "$wheels.tmp"
  mkdir -p "$wheels.tmp"
  "$py" -m pip download -qq --no-cache-dir --dest "$wheels.tmp" --only-binary=:all: \
    --python-version "$py_version" --implementation cp --abi "cp${py_version/./}" \
    --platform manylinux_2_28_x86_64 "${index_args[@]}" \
    "$torch_spec" "${tool_specs[@]}" "${extra_specs[@]}"
  rm -rf "$wheels"
  mv "$wheels.tmp" "$wheels"
}

# One key per input that changes the result, so a changed spec rebuilds.
key=$(printf '%s\n' "$suite" "$packages" "$torch_spec" "${tool_specs[@]}" "${extra_specs[@]}" | sha256sum | cut -c1-12)
tarball="$cache/$suite-minbase-$(printf '%s' "$packages" | sha256sum | cut -c1-12).tar"
wheels="$cache/wheels-$key"
# Per process: builds in other clones use the same engine.
stage_tag="ddpk-base-rootfs:$key-$$"
container="ddpk-base-build-$key-$$"

mkdir -p "$cache"
# Two builds in one clone would share the cache: take turns.
exec 9>"$cache/.lock"
flock 9

cleanup() {
  docker rm -f "$container" >/dev/null 2>&1 || true
  docker rmi "$stage_tag" >/dev/null 2>&1 || true
  remove_tree "$cache/rootfs.tmp"
  rm -rf "$wheels.tmp" "$tarball.tmp"
}
trap cleanup EXIT
cleanup

[ -s "$tarball" ] || build_rootfs_tarball "$tarball"
[ -d "$wheels" ] || build_wheelhouse "$wheels"
# Inputs of earlier specs would only fill the disk.
find "$cache" -mindepth 1 -maxdepth 1 \( -name '*-minbase-*.tar' -o -name 'wheels-*' \) \
  ! -path "$tarball" ! -path "$wheels" -exec rm -rf {} +

log "docker import $tarball"
docker import --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --change "ENV LANG=C.UTF-8" "$tarball" "$stage_tag" >/dev/null

log "installing $torch_spec into $venv (offline)"
# Offline on purpose: everything comes from the wheelhouse, as in CI.
docker run --name "$container" --network none -v "$wheels:/wheels:ro" "$stage_tag" \
  /bin/sh -eu -c "
    python3 -m venv $venv
    $venv/bin/python -m pip install -q --no-cache-dir --no-index --find-links /wheels --upgrade ${tool_specs[*]@Q}
    $venv/bin/python -m pip install -q --no-cache-dir --no-index --find-links /wheels ${torch_spec@Q} ${extra_specs[*]@Q}
    # C++ headers and CMake files serve only extension builds (this image has
    # no compiler); the C++ test binaries and protoc serve no one at run time.
    torch_dir=\$(echo $venv/lib/python*/site-packages/torch)
    rm -rf \"\$torch_dir/include\" \"\$torch_dir/share\" \"\$torch_dir/test\" \\
      \"\$torch_dir\"/bin/test_* \"\$torch_dir\"/bin/*Test \"\$torch_dir\"/bin/protoc* /root/.cache /var/log/*.log
    $venv/bin/python -c 'import torch, torch.distributed; print(\"torch\", torch.__version__)'
  "

previous=$(docker image inspect --format '{{.Id}}' "$image_tag" 2>/dev/null || true)
docker commit \
  --change "ENV PATH=$venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --change "ENV LANG=C.UTF-8" \
  --change 'CMD ["python3"]' \
  --change "LABEL org.opencontainers.image.title=ddpk-base-cpu" \
  --change "LABEL org.opencontainers.image.description=\"Offline CPU stand-in for the PyTorch runtime base: Debian $suite minbase, python $py_version, $torch_spec\"" \
  "$container" "$image_tag" >/dev/null

# A rebuild leaves the image it replaced untagged; drop it unless a container uses it.
if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect --format '{{.Id}}' "$image_tag")" ]; then
  docker rmi "$previous" >/dev/null 2>&1 || true
fi
log "built $image_tag: $(docker run --rm --network none "$image_tag" python3 -c 'import sys, torch; print(sys.executable, "torch", torch.__version__)')"
