#!/usr/bin/env bash
# Build the local sandbox images (README: The sandbox). Nothing is ever pulled.
#
#   toolreg/base:latest         scratch + Debian's busybox-static + examples/tools/*.sh
#   toolreg/python-root:latest  debootstrap'ed Debian (minbase + python3), built only when missing
#   toolreg/python:latest       python-root + examples/tools/*.py
#
# base and python are rebuilt only when the sha256 of their build context (Dockerfile, staged
# files, tool sources; for python also the python-root image id) differs from the image's
# io.toolreg.build-hash label. Delete toolreg/python-root to force a new debootstrap.
#
# Overrides: TOOLREG_DEBIAN_MIRROR (default: the machine's apt mirror, else deb.debian.org),
#            TOOLREG_DEBIAN_SUITE (default bookworm), TOOLREG_TOOLS_DIR (default examples/tools),
#            TMPDIR (where debootstrap runs; default /var/tmp, must allow exec and mknod).
set -Eeuo pipefail

START_SECONDS=$SECONDS
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
TOOLS_DIR="${TOOLREG_TOOLS_DIR:-$REPO/examples/tools}"
SUITE="${TOOLREG_DEBIAN_SUITE:-bookworm}"
BASE_IMAGE=toolreg/base:latest
ROOT_IMAGE=toolreg/python-root:latest  # python/Dockerfile names it in FROM
PYTHON_IMAGE=toolreg/python:latest
HASH_LABEL=io.toolreg.build-hash
DEBOOTSTRAP_INCLUDE=python3
# The daemon may be older than the CLI (docker.io 20.10 vs CLI 28) and buildx is usually not
# installed; the classic builder needs neither, and our builds have no RUN steps anyway.
export DOCKER_BUILDKIT="${DOCKER_BUILDKIT:-0}"

log() { printf 'build.sh: %s\n' "$*"; }
die() { printf 'build.sh: ERROR: %s\n' "$*" >&2; exit 1; }

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

pkg_installed() {
    [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]
}

# Install a Debian package when missing (root + Debian only); apt-get update only then.
ensure_pkg() {
    local pkg="$1"
    pkg_installed "$pkg" && return 0
    if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        die "package '$pkg' is missing; install it (Debian: apt-get install $pkg) and rerun"
    fi
    log "installing $pkg (apt-get) ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null
}

image_label() {  # prints the build-hash label of an image, or nothing when it is missing
    docker image inspect -f "{{index .Config.Labels \"$HASH_LABEL\"}}" "$1" 2>/dev/null || true
}

image_id() { docker image inspect -f '{{.Id}}' "$1" 2>/dev/null || true; }

# sha256 of a directory's names, modes, link targets and contents (not owners or times).
tree_hash() {
    tar -C "$1" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - . | sha256sum |
        cut -d' ' -f1
}

# docker build CONTEXT IMAGE HASH: build with the hash label; drop the image it replaces.
docker_build() {
    local ctx="$1" image="$2" hash="$3" old
    old="$(image_id "$image")"
    docker build --network none --label "$HASH_LABEL=$hash" -t "$image" "$ctx" 2>&1 |
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
    local ctx="$WORK/base" rootfs bb applet hash
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
    if [[ "$(image_label "$BASE_IMAGE")" == "$hash" ]]; then
        log "$BASE_IMAGE up to date"
        return 0
    fi
    log "building $BASE_IMAGE ..."
    docker_build "$ctx" "$BASE_IMAGE" "$hash"
    log "built $BASE_IMAGE"
}

# -------------------------------------------------------------------- toolreg/python-root
# The machine's Debian mirror (deb822 .sources or one-line .list), else deb.debian.org.
detect_mirror() {
    local f uris=() u
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -r "$f" ]] || continue
        # shellcheck disable=SC2207
        uris+=($(sed -n 's/^URIs:[[:space:]]*//p' "$f"))
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -r "$f" ]] || continue
        # shellcheck disable=SC2207
        uris+=($(sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]\+\).*/\2/p' "$f"))
    done
    for u in "${uris[@]}"; do
        [[ "$u" =~ ^https?://.*/debian/?$ ]] && { echo "${u%/}"; return 0; }
    done
    echo http://deb.debian.org/debian
}

build_python_root() {
    local root="$WORK/root" mirror arch recipe
    if docker image inspect "$ROOT_IMAGE" >/dev/null 2>&1; then
        log "$ROOT_IMAGE present (delete it to redo debootstrap)"
        return 0
    fi
    [[ "$(id -u)" == 0 ]] || die "building $ROOT_IMAGE needs root (debootstrap)"
    ensure_pkg debootstrap
    mirror="${TOOLREG_DEBIAN_MIRROR:-$(detect_mirror)}"
    arch="$(dpkg --print-architecture)"
    recipe="debootstrap --variant=minbase --include=$DEBOOTSTRAP_INCLUDE $SUITE $arch"
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
    log "debootstrap took $((SECONDS - t0))s; stripping caches, docs and man pages"
    rm -rf "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/var/cache/debconf/*-old \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
        "$root"/usr/share/locale/* "$root"/usr/share/lintian "$root"/var/log/* \
        "$root"/tmp/* "$root"/var/tmp/* "$root"/root/.cache
    find "$root/dev" -mindepth 1 -delete  # Docker provides /dev
    # Docker mounts its own; do not ship the build host's.
    : >"$root/etc/resolv.conf"
    : >"$root/etc/hostname"
    install -d -m 0755 "$root/workspace" "$root/work" "$root/opt/toolreg/tools"
    [[ -x "$root/usr/bin/python3" ]] || die "python3 missing from the debootstrap root"

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
    local ctx="$WORK/python" hash
    mkdir -p "$ctx"
    cp "$HERE/python/Dockerfile" "$ctx/"
    copy_tools '*.py' "$ctx/tools" 0644
    # Also hash the root image id, so a new debootstrap root rebuilds this image.
    hash="$({ tree_hash "$ctx"; image_id "$ROOT_IMAGE"; } | sha256sum | cut -d' ' -f1)"
    if [[ "$(image_label "$PYTHON_IMAGE")" == "$hash" ]]; then
        log "$PYTHON_IMAGE up to date"
        return 0
    fi
    log "building $PYTHON_IMAGE ..."
    docker_build "$ctx" "$PYTHON_IMAGE" "$hash"
    log "built $PYTHON_IMAGE"
}

main() {
    if ! { command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1; }; then
        die "no Docker engine answers; run scripts/ensure_docker.sh first"
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
