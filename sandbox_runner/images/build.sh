#!/usr/bin/env bash
# Build the local sandbox images (docs/explanation/sandbox.md). Nothing is ever pulled.
#
#   toolreg/base:latest         scratch + Debian's busybox-static + the example tools' *.sh
#   toolreg/python-root:latest  python3 and what it loads, taken from a debootstrap'ed Debian
#                               (minbase + python3 + busybox-static); no apt, dpkg or perl
#   toolreg/python:latest       python-root + the example tools' *.py
#
# base and python are rebuilt only when the sha256 of their build context (Dockerfile, staged
# files, tool sources; for python also the python-root image id) differs from the image's
# io.toolreg.build-hash label. Delete toolreg/python-root to force a new debootstrap.
# Each image also carries io.toolreg.source-hash: the sha256 of its sources as this package
# ships them (Dockerfile, users, tool files; not the host's busybox or Debian root), which
# `toolreg doctor` recomputes to tell an image of this version from an older one.
#
# This script travels in the wheel (sandbox_runner/images/); `toolreg images build` and
# `make images` both run it, so both give the same images with the same hashes.
#
# Overrides: TOOLREG_DEBIAN_MIRROR (default: the Debian mirror of the machine's apt sources;
#            with none there, the build stops and asks for it),
#            TOOLREG_DEBIAN_SUITE (default bookworm), TOOLREG_TOOLS_DIR (default: the packaged example tools,
#            registry_server/examples/tools beside this package),
#            TMPDIR (where debootstrap runs; default /var/tmp, must allow exec and mknod).
set -Eeuo pipefail

START_SECONDS=$SECONDS
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TOOLS_DIR="${TOOLREG_TOOLS_DIR:-$HERE/../../registry_server/examples/tools}"
SUITE="${TOOLREG_DEBIAN_SUITE:-bookworm}"
BASE_IMAGE=toolreg/base:latest
ROOT_IMAGE=toolreg/python-root:latest  # python/Dockerfile names it in FROM
PYTHON_IMAGE=toolreg/python:latest
HASH_LABEL=io.toolreg.build-hash
SOURCE_LABEL=io.toolreg.source-hash
DEBOOTSTRAP_INCLUDE=python3,busybox-static
# Parts of the standard library no sandboxed tool uses (GUI, tests, installers, 2to3).
STDLIB_LEFT_OUT=(test idlelib tkinter turtledemo ensurepip lib2to3 pydoc_data)
SLIM_RECIPE_VERSION=2  # bump when slim_root changes: the root is rebuilt
# The daemon may be older than the CLI (docker.io 20.10 vs CLI 28) and buildx is usually not
# installed; the classic builder needs neither, and our builds have no RUN steps anyway.
export DOCKER_BUILDKIT="${DOCKER_BUILDKIT:-0}"

log() { printf 'build.sh: %s\n' "$*"; }
die() { printf 'build.sh: ERROR: %s\n' "$*" >&2; exit 1; }

# What reruns this build and what starts an engine, as the host has this script: from a
# checkout (the Makefile's targets) or an installed wheel (sandbox_runner/pieces.py says
# the same to `toolreg doctor` and `toolreg serve`).
if [[ -f "$HERE/../../Makefile" ]]; then
    RERUN="make images (or toolreg images build)"
    START_ENGINE="make engine"
else
    RERUN="toolreg images build"
    START_ENGINE="sudo apt-get install docker.io runsc && sudo dockerd (or start your engine)"
fi

WORK="$(mktemp -d "${TMPDIR:-/var/tmp}/toolreg-images.XXXXXX")"
cleanup() {
    # debootstrap may leave /proc or /sys mounted inside the root after a failure.
    if [[ -d "$WORK/root" ]]; then
        grep -o " $WORK/root[^ ]*" /proc/mounts | sort -r | while read -r m; do umount -l "$m" || true; done
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'die "failed at line $LINENO: $BASH_COMMAND"' ERR

# shellcheck source=debian.sh
source "$HERE/debian.sh"

ensure_pkg() {
    local pkg="$1"
    pkg_installed "$pkg" && return 0
    if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        die "package '$pkg' is missing; install it (Debian: sudo apt-get install $pkg), then rerun: $RERUN"
    fi
    apt_install "$pkg"
}

image_label() {  # prints the build-hash label of an image, or nothing when it is missing
    docker image inspect -f "{{index .Config.Labels \"$HASH_LABEL\"}}" "$1" 2>/dev/null || true
}

source_label() { docker image inspect -f "{{index .Config.Labels \"$SOURCE_LABEL\"}}" "$1" 2>/dev/null || true; }

image_id() { docker image inspect -f '{{.Id}}' "$1" 2>/dev/null || true; }

# sha256 of a directory's names, modes, link targets and contents (not owners or times).
tree_hash() {
    tar -C "$1" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - . | sha256sum |
        cut -d' ' -f1
}

# source_hash DIR FILE...: sha256 of the lines "<sha256 of FILE>  <FILE>" for the named
# files, relative to DIR, sorted by name (registry_server/install/images.py computes the same).
source_hash() {
    local dir="$1"
    shift
    (cd "$dir" && printf '%s\n' "$@" | LC_ALL=C sort | while read -r f; do sha256sum "$f"; done) |
        sha256sum | cut -d' ' -f1
}

# docker build CONTEXT IMAGE HASH SOURCE_HASH: build with the labels; drop the image it
# replaces.
docker_build() {
    local ctx="$1" image="$2" hash="$3" src_hash="$4" old
    old="$(image_id "$image")"
    docker build --network none --label "$HASH_LABEL=$hash" --label "$SOURCE_LABEL=$src_hash" \
        -t "$image" "$ctx" 2>&1 |
        grep -v -e 'DEPRECATED: The legacy builder' -e 'BuildKit is currently disabled' \
            -e 'Install the buildx component' -e 'https://docs.docker.com/go/buildx/' \
            -e '^ *environment-variable\.$' -e '^ *$' |
        sed 's/^/    | /'
    docker image inspect "$image" >/dev/null 2>&1 || die "docker build of $image failed"
    if [[ -n "$old" && "$old" != "$(image_id "$image")" ]]; then
        # Only if now untagged and unused; otherwise leave it alone.
        docker image rm "$old" >/dev/null 2>&1 || true
    fi
}

copy_tools() {  # copy_tools GLOB DEST MODE
    local f
    mkdir -p "$2"
    for f in "$TOOLS_DIR"/$1; do
        [[ -f "$f" ]] && install -m "$3" "$f" "$2/"
    done
    return 0
}

# ---------------------------------------------------------------------------- toolreg/base
build_base() {
    local ctx="$WORK/base" rootfs bb applet hash src_hash
    ensure_pkg busybox-static
    bb="$(dpkg -L busybox-static | grep -E '/bin/busybox$' | head -n1)"
    [[ -x "$bb" ]] || die "busybox-static is installed but its busybox binary was not found"

    rootfs="$ctx/rootfs"
    mkdir -p "$rootfs"/{bin,etc,work,root} "$rootfs/opt/toolreg/tools"
    install -m 0755 "$bb" "$rootfs/bin/busybox"
    for applet in $("$bb" --list); do
        [[ "$applet" == busybox ]] || ln -s busybox "$rootfs/bin/$applet"
    done
    install -m 0644 "$HERE/base/passwd" "$HERE/base/group" "$rootfs/etc/"
    install -d -m 1777 "$rootfs/tmp"
    chmod 0755 "$rootfs/work"
    chmod 0700 "$rootfs/root"
    copy_tools '*.sh' "$rootfs/opt/toolreg/tools" 0755
    cp "$HERE/base/Dockerfile" "$ctx/"

    hash="$(tree_hash "$ctx")"
    src_hash="$(cd "$ctx" && source_hash . Dockerfile rootfs/etc/passwd rootfs/etc/group \
        $(cd "$ctx" && find rootfs/opt/toolreg/tools -type f))"
    if [[ "$(image_label "$BASE_IMAGE")" == "$hash" && "$(source_label "$BASE_IMAGE")" == "$src_hash" ]]
    then
        log "$BASE_IMAGE up to date"
        return 0
    fi
    log "building $BASE_IMAGE ..."
    docker_build "$ctx" "$BASE_IMAGE" "$hash" "$src_hash"
    log "built $BASE_IMAGE"
}

# -------------------------------------------------------------------- toolreg/python-root
# Copy a file of the debootstrap root to the same path in the slim root, following symlinks
# (the path a program asks for becomes a symlink to the real file when they differ).
take() {
    local from="$1" to="$2" path="$3" real
    real="$(chroot "$from" readlink -f "$path")"
    [[ -e "$to$real" ]] || { mkdir -p "$to$(dirname "$real")"; cp -a "$from$real" "$to$real"; }
    if [[ "$path" != "$real" && ! -e "$to$path" && ! -L "$to$path" ]]; then
        mkdir -p "$to$(dirname "$path")"
        ln -s "$real" "$to$path"
    fi
}

# The image root: python3, its standard library (less STDLIB_LEFT_OUT), the shared
# libraries the interpreter and its extension modules load, busybox as /bin/sh and the
# usual commands, time zones, and the users. No package manager, no perl, no docs.
slim_root() {
    local from="$1" to="$2" py lib applet top
    mkdir -p "$to"
    for top in bin sbin lib lib32 lib64 libx32; do  # the merged-/usr symlinks
        if [[ -L "$from/$top" ]]; then
            cp -a "$from/$top" "$to/$top"
            mkdir -p "$to/$(readlink "$from/$top")"  # e.g. usr/lib64: the link must not dangle
        fi
    done
    py="$(chroot "$from" readlink -f /usr/bin/python3)"
    take "$from" "$to" /usr/bin/python3
    local stdlib="/usr/lib/$(basename "$py")"
    mkdir -p "$to$stdlib"
    tar -C "$from$stdlib" "${STDLIB_LEFT_OUT[@]/#/--exclude=./}" --exclude='./config-*' -cf - . |
        tar -C "$to$stdlib" -xf -
    mkdir -p "$to/etc"
    if [[ -d "$from/etc/$(basename "$py")" ]]; then  # Debian's sitecustomize
        cp -a "$from/etc/$(basename "$py")" "$to/etc/"
    fi
    mkdir -p "$to/usr/lib/python3/dist-packages"
    # shellcheck disable=SC2016
    chroot "$from" sh -c 'ldd "$0" "$@" 2>/dev/null' "$py" "$stdlib"/lib-dynload/*.so |
        awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $1 !~ /:$/ {print $1}' | sort -u |
        while read -r lib; do take "$from" "$to" "$lib"; done
    take "$from" "$to" /bin/busybox
    for applet in $(chroot "$from" /bin/busybox --list); do
        case "$applet" in dpkg | dpkg-deb | rpm | rpm2cpio) continue ;; esac  # no installers
        [[ -e "$to/usr/bin/$applet" || -L "$to/usr/bin/$applet" ]] || ln -s busybox "$to/usr/bin/$applet"
    done
    mkdir -p "$to/usr/share" "$to/etc"
    cp -a "$from/usr/share/zoneinfo" "$to/usr/share/" 2>/dev/null || true
    cp -a "$from/etc/passwd" "$from/etc/group" "$to/etc/"
    : >"$to/etc/resolv.conf"  # Docker mounts its own; do not ship the build host's
    : >"$to/etc/hostname"
    install -d -m 1777 "$to/tmp" "$to/var/tmp"
    install -d -m 0755 "$to/dev" "$to/proc" "$to/sys" "$to/workspace" "$to/work" \
        "$to/opt/toolreg/tools"
    [[ -x "$to/usr/bin/python3" ]] || die "python3 missing from the slim root"
    chroot "$to" /usr/bin/python3 -c 'import json, re, sqlite3, subprocess, zoneinfo' ||
        die "python3 in the slim root cannot import its standard library"
}

build_python_root() {
    local root="$WORK/root" mirror arch recipe
    arch="$(dpkg --print-architecture)"
    recipe="debootstrap --variant=minbase --include=$DEBOOTSTRAP_INCLUDE $SUITE $arch"
    recipe+=" | slim v$SLIM_RECIPE_VERSION without ${STDLIB_LEFT_OUT[*]}"
    if [[ "$(image_label "$ROOT_IMAGE")" == "$(printf '%s' "$recipe" | sha256sum | cut -d' ' -f1)" ]]
    then
        log "$ROOT_IMAGE up to date (delete it to redo debootstrap)"
        return 0
    fi
    [[ "$(id -u)" == 0 ]] || die "building $ROOT_IMAGE needs root (debootstrap): run sudo $RERUN, once"
    # The mirror is not part of the recipe (any mirror gives the same packages), and is
    # looked up only when debootstrap runs: an up-to-date root needs no apt sources.
    mirror="${TOOLREG_DEBIAN_MIRROR:-}"
    if [[ -z "$mirror" ]] && ! mirror="$(debian_mirror /etc/apt "$SUITE" 2>"$WORK/mirror.err")"
    then
        die "$(tr '\n' ' ' <"$WORK/mirror.err")"  # it says what to set
    fi
    ensure_pkg debootstrap
    log "building $ROOT_IMAGE: $recipe from $mirror (a few minutes) ..."
    local t0=$SECONDS
    if ! debootstrap --variant=minbase --include="$DEBOOTSTRAP_INCLUDE" --arch="$arch" \
        "$SUITE" "$root" "$mirror" 2>&1 | tee "$WORK/debootstrap.log" |
        grep --line-buffered -E '^I: (Retrieving Release|Resolving dependencies of (required|base)|Checking component|Installing core|Unpacking the base|Configuring the base|Base system installed)' |
        sed -u 's/^/    | /'; then
        tail -n 30 "$WORK/debootstrap.log" >&2
        die "debootstrap failed (see above)"
    fi
    grep -q '^I: Base system installed successfully' "$WORK/debootstrap.log" || {
        tail -n 30 "$WORK/debootstrap.log" >&2
        die "debootstrap did not finish"
    }
    log "debootstrap took $((SECONDS - t0))s; taking python3 and what it loads"
    slim_root "$root" "$WORK/slim"
    rm -rf "$root"
    root="$WORK/slim"

    log "importing $ROOT_IMAGE ..."
    tar -C "$root" --numeric-owner -cf - . |
        docker import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV LANG=C.UTF-8' \
            --change 'CMD ["/bin/sh"]' \
            --change "LABEL $HASH_LABEL=$(printf '%s' "$recipe" | sha256sum | cut -d' ' -f1)" \
            --change "LABEL io.toolreg.recipe=\"$recipe\"" \
            --message "toolreg: $recipe" - "$ROOT_IMAGE" >/dev/null
    rm -rf "$root"
    log "built $ROOT_IMAGE"
}

# ------------------------------------------------------------------------- toolreg/python
build_python() {
    local ctx="$WORK/python" hash src_hash
    mkdir -p "$ctx"
    cp "$HERE/python/Dockerfile" "$ctx/"
    copy_tools '*.py' "$ctx/tools" 0644
    # Also hash the root image id, so a new debootstrap root rebuilds this image.
    hash="$({ tree_hash "$ctx"; image_id "$ROOT_IMAGE"; } | sha256sum | cut -d' ' -f1)"
    src_hash="$(source_hash "$ctx" Dockerfile $(cd "$ctx" && find tools -type f))"
    if [[ "$(image_label "$PYTHON_IMAGE")" == "$hash" && "$(source_label "$PYTHON_IMAGE")" == "$src_hash" ]]
    then
        log "$PYTHON_IMAGE up to date"
        return 0
    fi
    log "building $PYTHON_IMAGE ..."
    docker_build "$ctx" "$PYTHON_IMAGE" "$hash" "$src_hash"
    log "built $PYTHON_IMAGE"
}

main() {
    if ! { command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1; }; then
        die "no Docker engine answers; start one: $START_ENGINE, then $RERUN"
    fi
    [[ -d "$TOOLS_DIR" ]] || die "tool sources directory $TOOLS_DIR not found"
    # Two builds at once (e.g. parallel test sessions) would race on the tags.
    exec 9>"${TMPDIR:-/tmp}/toolreg-images.lock"
    flock 9
    build_base
    build_python_root
    build_python
    log "done in $((SECONDS - START_SECONDS))s"
}

main "$@"
