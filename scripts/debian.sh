# shellcheck shell=bash
# Debian package helpers shared by the set-up scripts (sourced, not run). The caller
# defines log() for its progress lines.

is_debian() {
    [[ -r /etc/debian_version ]] || grep -qsE '^(ID|ID_LIKE)=.*debian' /etc/os-release
}

pkg_installed() {
    [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]
}

# apt-get install the given packages; apt-get update only when something is missing.
apt_install() {
    local missing=() p
    for p in "$@"; do pkg_installed "$p" || missing+=("$p"); done
    if ((${#missing[@]} == 0)); then
        log "packages already installed: $*"
        return 0
    fi
    log "installing ${missing[*]} (apt-get update + install) ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
