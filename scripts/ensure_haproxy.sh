#!/usr/bin/env bash
# Make sure an haproxy binary is installed for toolreg's load-balancer tests, and print its path.
#
#   * haproxy already on PATH   -> print its path, change nothing
#   * not Debian, or not root   -> say what to install, exit 1
#   * Debian + root             -> apt-get install haproxy; if the package started its own
#                                  service, stop and disable it: tests run their own haproxy
#                                  processes (`haproxy -f CFG -db`, see scripts/haproxy_config.py)
#
# No daemon is ever started here. Log lines go to stderr; stdout carries only the binary path.
# Wants HAProxy >= 2.6 (Debian 12 has 2.6): an older one is reported with a warning.
set -euo pipefail

PACKAGES=(haproxy)
MIN_VERSION=2.6

log() { printf 'ensure_haproxy: %s\n' "$*" >&2; }
die() { printf 'ensure_haproxy: ERROR: %s\n' "$*" >&2; exit 1; }

# shellcheck source=../sandbox_runner/images/debian.sh
source "$(dirname "${BASH_SOURCE[0]}")/../sandbox_runner/images/debian.sh"

haproxy_path() {
    command -v haproxy 2>/dev/null || { [[ -x /usr/sbin/haproxy ]] && echo /usr/sbin/haproxy; }
}

check_version() {
    local bin="$1" version
    version="$("$bin" -v 2>/dev/null | sed -nE '1s/^HA-?Proxy version ([0-9]+\.[0-9]+).*/\1/p')"
    if [[ -z "$version" ]]; then
        log "WARNING: could not read the version of ${bin}"
    elif [[ "$(printf '%s\n%s\n' "$MIN_VERSION" "$version" | sort -V | head -n 1)" != "$MIN_VERSION" ]]; then
        log "WARNING: ${bin} is HAProxy ${version}; toolreg's configs want >= ${MIN_VERSION}"
    fi
}

# The package's own service (Debian starts it on install): stop it and keep it from starting at
# boot. Only called right after this script installed the package, never for an haproxy that
# was already there (that one is somebody's, and running it is their business).
stop_package_service() {
    if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null 2>&1; then
        if systemctl is-active -q haproxy 2>/dev/null || systemctl is-enabled -q haproxy 2>/dev/null; then
            log "stopping and disabling the haproxy service (systemd)"
            systemctl disable --now -q haproxy >&2 || die "systemctl disable --now haproxy failed"
        fi
        return 0
    fi
    if [[ -x /etc/init.d/haproxy ]]; then
        if /etc/init.d/haproxy status >/dev/null 2>&1; then
            log "stopping the haproxy service (init.d)"
            if command -v service >/dev/null 2>&1; then
                service haproxy stop >&2 || die "service haproxy stop failed"
            else
                /etc/init.d/haproxy stop >&2 || die "/etc/init.d/haproxy stop failed"
            fi
        fi
        if command -v update-rc.d >/dev/null 2>&1; then
            update-rc.d haproxy disable >/dev/null 2>&1 || log "WARNING: update-rc.d haproxy disable failed"
        fi
    fi
    if [[ -s /run/haproxy.pid ]] && kill -0 "$(tr -dc '0-9' </run/haproxy.pid)" 2>/dev/null; then
        die "the packaged haproxy (pid $(tr -dc '0-9' </run/haproxy.pid)) still runs after stopping it"
    fi
}

main() {
    local bin
    if bin="$(haproxy_path)"; then
        check_version "$bin"
        printf '%s\n' "$bin"
        return 0
    fi

    if ! is_debian || [[ "$(id -u)" != 0 ]]; then
        cat >&2 <<'EOF'
ensure_haproxy: ERROR: haproxy is not installed, and this script can only install it on Debian
as root. Please install HAProxy >= 2.6 (Debian/Ubuntu: `apt-get install haproxy`; elsewhere your
distribution's package or https://www.haproxy.org/) so that `haproxy` is on PATH. Do not start
its service: the tests run their own haproxy processes.
EOF
        exit 1
    fi

    apt_install "${PACKAGES[@]}"
    stop_package_service
    bin="$(haproxy_path)" || die "haproxy still not found after installing ${PACKAGES[*]}"
    check_version "$bin"
    log "installed $("$bin" -v 2>/dev/null | head -n 1)"
    printf '%s\n' "$bin"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
