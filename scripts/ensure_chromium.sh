#!/usr/bin/env bash
# Make sure headless Chromium and its WebDriver are installed for toolreg's browser tests
# (tests/browser: the approval console driven by Selenium), and print the driver's path.
#
#   * chromium and chromedriver already on PATH -> print the driver's path, change nothing
#   * not Debian, or not root                   -> say what to install, exit 1
#   * Debian + root                             -> apt-get install chromium chromium-driver
#
# Debian's packages only: Selenium Manager and any other browser download are never used (the
# tests pass /usr/bin/chromedriver explicitly). Log lines go to stderr; stdout carries only the
# driver's path.
set -euo pipefail

PACKAGES=(chromium chromium-driver)

log() { printf 'ensure_chromium: %s\n' "$*" >&2; }
die() { printf 'ensure_chromium: ERROR: %s\n' "$*" >&2; exit 1; }

# shellcheck source=../sandbox_runner/images/debian.sh
source "$(dirname "${BASH_SOURCE[0]}")/../sandbox_runner/images/debian.sh"

found() {
    command -v chromium >/dev/null 2>&1 && command -v chromedriver 2>/dev/null
}

main() {
    local driver
    if driver="$(found)"; then
        printf '%s\n' "$driver"
        return 0
    fi
    if ! is_debian || [[ "$(id -u)" != 0 ]]; then
        cat >&2 <<'MSG'
ensure_chromium: ERROR: chromium and chromedriver are not both installed, and this script can
only install them on Debian as root. Please install Chromium and its matching WebDriver
(Debian/Ubuntu: `apt-get install chromium chromium-driver`) so that `chromium` and
`chromedriver` are on PATH.
MSG
        exit 1
    fi
    apt_install "${PACKAGES[@]}"
    driver="$(found)" || die "chromium/chromedriver still not found after installing ${PACKAGES[*]}"
    log "installed $(chromium --version 2>/dev/null | head -n 1)"
    printf '%s\n' "$driver"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
