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

# debian_mirror APT_DIR SUITE: the Debian archive this machine's apt uses, for debootstrap.
# Reads APT_DIR/sources.list and APT_DIR/sources.list.d/*.list (one-line format) and
# *.sources (deb822), in apt's order, binary ("deb") entries only, disabled ones skipped.
# The first URI listed for SUITE itself wins (so a -security or third-party entry never
# does); else the first whose path ends in /debian. None: a message on stderr, status 1.
# No mirror host is named here: the build uses what the machine is set up with.
debian_mirror() {
    local apt="$1" suite="$2" files=() f
    [[ -r "$apt/sources.list" ]] && files+=("$apt/sources.list")
    for f in "$apt"/sources.list.d/*.list "$apt"/sources.list.d/*.sources; do
        [[ -r "$f" ]] && files+=("$f")
    done
    if ((${#files[@]})) && awk -v suite="$suite" '
        function flush() {  # one deb822 stanza
            if (types ~ /(^| )deb( |$)/ && tolower(enabled) != "no") add(uris, suites)
            types = ""; uris = ""; suites = ""; enabled = ""; field = ""
        }
        function add(u, s,    n, i, list) {  # each URI of an entry with its suites
            n = split(u, list, " ")
            for (i = 1; i <= n; i++) {
                if (list[i] !~ /^(https?|file):/) continue
                sub(/\/+$/, "", list[i])
                if (!exact && (" " s " ") ~ (" " suite " ")) exact = list[i]
                if (!debian && list[i] ~ /\/debian$/) debian = list[i]
            }
        }
        FNR == 1 { flush(); deb822 = FILENAME ~ /\.sources$/ }
        { sub(/\r$/, "") }
        /^[[:space:]]*#/ { next }
        !deb822 {  # deb [ options ] URI SUITE [COMPONENT ...]
            line = $0; sub(/#.*/, "", line); gsub(/\[[^]]*\]/, " ", line)
            if (split(line, w, " ") >= 3 && w[1] == "deb") add(w[2], w[3])
            next
        }
        /^[[:space:]]*$/ { flush(); next }
        /^[[:space:]]/ { if (field == "uris") uris = uris " " $0; else if (field == "suites") suites = suites " " $0; next }
        {
            field = tolower(substr($0, 1, index($0, ":") - 1)); value = substr($0, index($0, ":") + 1)
            gsub(/[[:space:]]+/, " ", value)
            if (field == "types") types = value
            else if (field == "uris") uris = value
            else if (field == "suites") suites = value
            else if (field == "enabled") { enabled = value; gsub(/ /, "", enabled) }
        }
        END {
            flush()
            gsub(/[[:space:]]+/, " ", exact)
            if (exact) print exact; else if (debian) print debian; else exit 1
        }' "${files[@]}"; then
        return 0
    fi
    printf '%s\n' "no Debian mirror for '$suite' in $apt/sources.list or $apt/sources.list.d/" \
        "(one-line .list or deb822 .sources). Set TOOLREG_DEBIAN_MIRROR to the URL of a Debian" \
        "archive that has '$suite', e.g. TOOLREG_DEBIAN_MIRROR=http://<your mirror>/debian" >&2
    return 1
}
