#!/usr/bin/env bash
# Make sure rsyslogd and its TLS stream driver are installed for toolreg's SIEM export tests
# (tests/integration/test_siem_export.py: OCSF events sent over syslog/TLS, RFC 5425), and print
# the daemon's path.
#
#   * rsyslogd and its gtls driver already there -> print the path, change nothing
#   * not Debian, or not root                    -> say what to install, exit 1
#   * Debian + root                              -> apt-get install rsyslog rsyslog-gnutls; if the
#                                                   package started the machine's own syslog
#                                                   service, stop and disable it: the tests run
#                                                   their own rsyslogd (`rsyslogd -n -f CONF`) on
#                                                   a loopback port, never the system's
#
# No daemon is ever started here. Log lines go to stderr; stdout carries only the daemon's path.
set -euo pipefail

PACKAGES=(rsyslog rsyslog-gnutls)

log() { printf 'ensure_rsyslog: %s\n' "$*" >&2; }
die() { printf 'ensure_rsyslog: ERROR: %s\n' "$*" >&2; exit 1; }

# shellcheck source=../sandbox_runner/images/debian.sh
source "$(dirname "${BASH_SOURCE[0]}")/../sandbox_runner/images/debian.sh"

rsyslogd_path() {
    command -v rsyslogd 2>/dev/null || { [[ -x /usr/sbin/rsyslogd ]] && echo /usr/sbin/rsyslogd; }
}

# The gtls network stream driver is a module of its own (Debian: rsyslog-gnutls).
has_gtls() {
    local dir
    for dir in /usr/lib/*/rsyslog /usr/lib/rsyslog; do
        [[ -e "$dir/lmnsd_gtls.so" ]] && return 0
    done
    return 1
}

# The package's own service (Debian starts it on install): stop it and keep it from starting at
# boot. Only called right after this script installed the package.
stop_package_service() {
    if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null 2>&1; then
        if systemctl is-active -q rsyslog 2>/dev/null || systemctl is-enabled -q rsyslog 2>/dev/null; then
            log "stopping and disabling the rsyslog service (systemd)"
            systemctl disable --now -q rsyslog >&2 || die "systemctl disable --now rsyslog failed"
        fi
        return 0
    fi
    if [[ -x /etc/init.d/rsyslog ]]; then
        if /etc/init.d/rsyslog status >/dev/null 2>&1; then
            log "stopping the rsyslog service (init.d)"
            if command -v service >/dev/null 2>&1; then
                service rsyslog stop >&2 || die "service rsyslog stop failed"
            else
                /etc/init.d/rsyslog stop >&2 || die "/etc/init.d/rsyslog stop failed"
            fi
        fi
        if command -v update-rc.d >/dev/null 2>&1; then
            update-rc.d rsyslog disable >/dev/null 2>&1 || log "WARNING: update-rc.d rsyslog disable failed"
        fi
    fi
}

main() {
    local bin
    if bin="$(rsyslogd_path)" && has_gtls; then
        printf '%s\n' "$bin"
        return 0
    fi
    if ! is_debian || [[ "$(id -u)" != 0 ]]; then
        cat >&2 <<'MSG'
ensure_rsyslog: ERROR: rsyslogd with its GnuTLS stream driver is not installed, and this script
can only install it on Debian as root. Please install rsyslog and its TLS driver (Debian/Ubuntu:
`apt-get install rsyslog rsyslog-gnutls`) so that `rsyslogd` is on PATH. Its service need not
run: the tests start their own rsyslogd.
MSG
        exit 1
    fi
    apt_install "${PACKAGES[@]}"
    stop_package_service
    bin="$(rsyslogd_path)" || die "rsyslogd still not found after installing ${PACKAGES[*]}"
    has_gtls || die "the gtls stream driver (lmnsd_gtls.so) is missing after installing ${PACKAGES[*]}"
    log "installed $("$bin" -v 2>/dev/null | head -n 1)"
    printf '%s\n' "$bin"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
