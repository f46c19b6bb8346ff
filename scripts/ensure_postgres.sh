#!/usr/bin/env bash
# Make sure a PostgreSQL server for toolreg's tests runs on this machine, and print its URL.
#
#   ensure_postgres.sh [url]  start the test cluster if needed (creating it, and installing Debian's
#                             `postgresql` when its server is missing), make sure role and database
#                             `toolreg` exist, print ONE line on stdout:
#                               postgresql://toolreg:PASSWORD@127.0.0.1:PORT/toolreg
#   ensure_postgres.sh start  the same, without printing the URL (after `stop`, for fault tests)
#   ensure_postgres.sh stop [fast|immediate|smart]
#                             stop the test cluster (default mode: fast; immediate = crash-like)
#   ensure_postgres.sh status exit 0 when it answers, 3 when it does not
#
# The test cluster is a DEDICATED cluster "toolreg" (pg_createcluster VERSION toolreg), listening
# on 127.0.0.1 only; the machine's default cluster (e.g. 15/main) is never touched. The role
# `toolreg` (LOGIN CREATEDB: tests create one database per run) gets a password generated once
# and kept in a root-only file, reused on later runs. fsync stays on: durability tests rely on it.
# Log lines go to stderr; stdout carries only the URL.
#
#   * it already answers with that password -> print the URL, change nothing (fast: no root needed,
#                                              only read access to the password file)
#   * not Debian, or not root               -> say what to install/run, exit 1
#   * Debian + root                         -> apt-get install postgresql (only if missing), create
#                                              the cluster, start it with pg_ctlcluster (works with
#                                              or without systemd), wait for pg_isready
#
# Overrides (mostly for tests):
#   TOOLREG_PG_PORT       port of the test cluster           (default 55432)
#   TOOLREG_PG_CLUSTER    cluster name                        (default toolreg)
#   TOOLREG_PG_STATE_DIR  password file and lock live here    (default /var/lib/toolreg-pg)
#   TOOLREG_PG_WAIT       seconds to wait for it to answer    (default 60)
set -euo pipefail

PG_PORT="${TOOLREG_PG_PORT:-55432}"
PG_CLUSTER="${TOOLREG_PG_CLUSTER:-toolreg}"
STATE_DIR="${TOOLREG_PG_STATE_DIR:-/var/lib/toolreg-pg}"
PG_WAIT="${TOOLREG_PG_WAIT:-60}"
PASSWORD_FILE="${STATE_DIR}/password"
LOCK_FILE="${STATE_DIR}/lock"
PG_HOST=127.0.0.1
PG_ROLE=toolreg
PG_DB=toolreg
PACKAGES=(postgresql)

log() { printf 'ensure_postgres: %s\n' "$*" >&2; }
die() { printf 'ensure_postgres: ERROR: %s\n' "$*" >&2; exit 1; }

if ! [[ "$PG_PORT" =~ ^[0-9]+$ ]] || ((PG_PORT < 1 || PG_PORT > 65535)); then
    die "TOOLREG_PG_PORT must be a port number, not '${PG_PORT}'"
fi
[[ "$PG_CLUSTER" =~ ^[A-Za-z0-9_-]+$ ]] || die "TOOLREG_PG_CLUSTER '${PG_CLUSTER}' is not a valid name"
[[ "$PG_WAIT" =~ ^[0-9]+$ ]] || die "TOOLREG_PG_WAIT must be a number of seconds, not '${PG_WAIT}'"

# shellcheck source=../sandbox_runner/images/debian.sh
source "$(dirname "${BASH_SOURCE[0]}")/../sandbox_runner/images/debian.sh"

# The major version of the test cluster: the one it already has, else the newest server installed.
pg_version() {
    local d v best=""
    for d in /etc/postgresql/*/"$PG_CLUSTER"; do
        v="$(basename "$(dirname "$d")")"
        if [[ -f "$d/postgresql.conf" && -x "/usr/lib/postgresql/$v/bin/postgres" ]]; then
            printf '%s\n' "$v"
            return 0
        fi
    done
    for d in /usr/lib/postgresql/*/bin/postgres; do
        [[ -x "$d" ]] || continue
        v="$(basename "$(dirname "$(dirname "$d")")")"
        if [[ -z "$best" ]] || [[ "$(printf '%s\n%s\n' "$best" "$v" | sort -V | tail -n 1)" == "$v" ]]; then
            best="$v"
        fi
    done
    [[ -n "$best" ]] || return 1
    printf '%s\n' "$best"
}

server_installed() {
    command -v pg_ctlcluster >/dev/null 2>&1 && command -v pg_createcluster >/dev/null 2>&1 &&
        command -v pg_isready >/dev/null 2>&1 && command -v psql >/dev/null 2>&1 &&
        pg_version >/dev/null
}

url() {
    printf 'postgresql://%s:%s@%s:%s/%s\n' "$PG_ROLE" "$(cat "$PASSWORD_FILE")" "$PG_HOST" "$PG_PORT" "$PG_DB"
}

answers() {
    command -v pg_isready >/dev/null 2>&1 &&
        pg_isready -q -h "$PG_HOST" -p "$PG_PORT" -t 2 >/dev/null 2>&1
}

# True when toolreg can log in with the stored password (the whole job is done already).
can_login() {
    [[ -r "$PASSWORD_FILE" && -s "$PASSWORD_FILE" ]] || return 1
    answers || return 1
    PGCONNECT_TIMEOUT=3 psql "$(url)" -XAtqc 'select 1' 2>/dev/null | grep -qx 1
}

need_root_on_debian() {
    if ! is_debian || [[ "$(id -u)" != 0 ]]; then
        cat >&2 <<EOF
ensure_postgres: ERROR: $1, and this script can only set PostgreSQL up on Debian as root.
Either run it as root (sudo) on Debian/Ubuntu, or provide a PostgreSQL server yourself:
  * install PostgreSQL >= 13 (Debian/Ubuntu: \`apt-get install postgresql\`; elsewhere
    https://www.postgresql.org/download/), listening on ${PG_HOST}:${PG_PORT};
  * create a role \`${PG_ROLE}\` WITH LOGIN CREATEDB PASSWORD '...' and a database \`${PG_DB}\` owned by it;
  * and point the tests at postgresql://${PG_ROLE}:PASSWORD@${PG_HOST}:${PG_PORT}/${PG_DB}.
EOF
        exit 1
    fi
}

# The settings toolreg's tests want; written to the cluster's conf.d (read after postgresql.conf).
cluster_conf() {
    cat <<EOF
# Written by toolreg's scripts/ensure_postgres.sh; overwritten on every run.
listen_addresses = '${PG_HOST}'
port = ${PG_PORT}
max_connections = 200
# Durability tests rely on these: never turn them off to make tests faster.
fsync = on
synchronous_commit = on
full_page_writes = on
# Small machine (2 cores): modest memory, quick checkpoints of small test databases.
shared_buffers = 128MB
work_mem = 4MB
maintenance_work_mem = 64MB
max_wal_size = 512MB
log_min_duration_statement = -1
log_line_prefix = '%m [%p] %q%u@%d '
EOF
}

pg_ctl() {
    # pg_ctlcluster redirects to systemctl when systemd runs, and runs pg_ctl itself otherwise.
    # 9>&-: the server must not inherit (and so hold forever) the lock taken in ensure().
    pg_ctlcluster "$@" >&2 9>&-
}

wait_ready() {
    local version="$1" waited=0
    while ! answers; do
        if ((waited >= PG_WAIT)); then
            local logfile="/var/log/postgresql/postgresql-${version}-${PG_CLUSTER}.log"
            log "PostgreSQL did not answer on ${PG_HOST}:${PG_PORT} within ${PG_WAIT}s; last lines of ${logfile}:"
            tail -n 25 "$logfile" >&2 2>/dev/null || true
            die "the ${version}/${PG_CLUSTER} cluster did not come up; see ${logfile}"
        fi
        if ((waited > 0 && waited % 5 == 0)); then log "waiting for PostgreSQL ... (${waited}s)"; fi
        sleep 1
        waited=$((waited + 1))
    done
}

cluster_running() {
    local version="$1" rc=0
    pg_ctlcluster "$version" "$PG_CLUSTER" status >/dev/null 2>&1 || rc=$?
    ((rc == 0))
}

ensure_password_file() {
    install -d -m 700 -o root -g root "$STATE_DIR"
    if [[ ! -s "$PASSWORD_FILE" ]]; then
        log "generating the ${PG_ROLE} password in ${PASSWORD_FILE}"
        local tmp="${PASSWORD_FILE}.tmp"
        (umask 077 && od -An -tx1 -N24 /dev/urandom | tr -d ' \n' >"$tmp")
        mv -f "$tmp" "$PASSWORD_FILE"
    fi
    chmod 600 "$PASSWORD_FILE"
    [[ "$(tr -d '0-9a-f' <"$PASSWORD_FILE")" == "" ]] ||
        die "${PASSWORD_FILE} holds something else than a hex password; remove it to get a new one"
}

ensure_cluster() {
    local version="$1" confdir="/etc/postgresql/$1/${PG_CLUSTER}"
    if [[ ! -f "${confdir}/postgresql.conf" ]]; then
        log "creating cluster ${version}/${PG_CLUSTER} on port ${PG_PORT}"
        # manual: the machine's `postgresql` service never starts it; this script does.
        pg_createcluster "$version" "$PG_CLUSTER" -p "$PG_PORT" --start-conf manual \
            --locale C.UTF-8 --encoding UTF8 >&2 9>&- -- --data-checksums ||
            die "pg_createcluster ${version} ${PG_CLUSTER} failed"
    fi
    local conf="${confdir}/conf.d/toolreg.conf" wanted
    wanted="$(cluster_conf)"
    mkdir -p "${confdir}/conf.d"
    if [[ ! -f "$conf" ]] || [[ "$(cat "$conf")" != "$wanted" ]]; then
        log "writing ${conf}"
        printf '%s\n' "$wanted" >"${conf}.tmp"
        chmod 644 "${conf}.tmp"
        mv -f "${conf}.tmp" "$conf"
        if cluster_running "$version"; then
            log "settings changed: restarting ${version}/${PG_CLUSTER}"
            pg_ctl "$version" "$PG_CLUSTER" restart
        fi
    fi
}

start_cluster() {
    local version="$1"
    if ! cluster_running "$version"; then
        log "starting cluster ${version}/${PG_CLUSTER} (port ${PG_PORT})"
        pg_ctl "$version" "$PG_CLUSTER" start ||
            die "pg_ctlcluster ${version} ${PG_CLUSTER} start failed; see /var/log/postgresql/postgresql-${version}-${PG_CLUSTER}.log"
    fi
    wait_ready "$version"
}

ensure_role_and_db() {
    local password
    password="$(cat "$PASSWORD_FILE")"
    # Over the Unix socket as the postgres superuser (peer auth). The password is fed on stdin so
    # that it never shows up in `ps`; it is hex, so it needs no quoting.
    runuser -u postgres -- psql -XqAt -v ON_ERROR_STOP=1 -p "$PG_PORT" -d postgres >/dev/null 9>&- <<SQL ||
SELECT format('CREATE ROLE %I', '${PG_ROLE}')
 WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '${PG_ROLE}')\gexec
ALTER ROLE ${PG_ROLE} WITH LOGIN CREATEDB NOSUPERUSER NOCREATEROLE PASSWORD '${password}';
SELECT format('CREATE DATABASE %I OWNER %I', '${PG_DB}', '${PG_ROLE}')
 WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = '${PG_DB}')\gexec
ALTER DATABASE ${PG_DB} OWNER TO ${PG_ROLE};
SQL
        die "could not create role/database ${PG_ROLE} in cluster ${PG_CLUSTER}"
}

ensure() {
    if can_login; then
        return 0
    fi
    if ! server_installed; then
        need_root_on_debian "no PostgreSQL server is installed (pg_ctlcluster / /usr/lib/postgresql/*/bin/postgres)"
        apt_install "${PACKAGES[@]}"
        server_installed || die "PostgreSQL server binaries still missing after installing ${PACKAGES[*]}"
    fi
    need_root_on_debian "the toolreg test cluster does not answer on ${PG_HOST}:${PG_PORT} with its password"

    install -d -m 700 -o root -g root "$STATE_DIR"
    (umask 077 && : >>"$LOCK_FILE")
    exec 9>>"$LOCK_FILE"
    flock -w 120 9 || die "another ensure_postgres.sh holds ${LOCK_FILE} for over 120s"
    if can_login; then # set up by whoever held the lock
        return 0
    fi
    local version
    version="$(pg_version)" || die "no PostgreSQL server found under /usr/lib/postgresql"
    ensure_password_file
    ensure_cluster "$version"
    start_cluster "$version"
    ensure_role_and_db
    can_login || die "role ${PG_ROLE} still cannot log in to ${PG_HOST}:${PG_PORT}/${PG_DB}; see /etc/postgresql/${version}/${PG_CLUSTER}/pg_hba.conf"
    log "PostgreSQL ${version}/${PG_CLUSTER} ready on ${PG_HOST}:${PG_PORT}"
}

stop() {
    local mode="${1:-fast}" version
    [[ "$mode" =~ ^(fast|immediate|smart)$ ]] || die "stop mode must be fast, immediate or smart, not '${mode}'"
    version="$(pg_version 2>/dev/null)" || die "no PostgreSQL server installed; nothing to stop"
    if [[ ! -f "/etc/postgresql/${version}/${PG_CLUSTER}/postgresql.conf" ]]; then
        log "no cluster ${version}/${PG_CLUSTER}; nothing to stop"
        return 0
    fi
    if ! cluster_running "$version"; then
        log "cluster ${version}/${PG_CLUSTER} is not running"
        return 0
    fi
    log "stopping cluster ${version}/${PG_CLUSTER} (mode ${mode})"
    local args=(-m "$mode")
    # systemctl knows no shutdown mode: a non-default one goes to pg_ctl directly.
    [[ "$mode" == fast ]] || args+=(--skip-systemctl-redirect)
    pg_ctl "${args[@]}" "$version" "$PG_CLUSTER" stop || die "pg_ctlcluster ${version} ${PG_CLUSTER} stop failed"
    local waited=0
    while answers; do
        ((waited < PG_WAIT * 10)) || die "PostgreSQL still answers on ${PG_HOST}:${PG_PORT} after stop"
        sleep 0.1
        waited=$((waited + 1))
    done
}

usage() {
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

main() {
    local cmd="${1:-url}"
    case "$cmd" in
        url | --url) ensure; url ;;
        start | --start) ensure ;;
        stop | --stop) shift; (($# <= 1)) || usage; stop "$@" ;;
        status | --status)
            if answers; then log "answers on ${PG_HOST}:${PG_PORT}"; else log "does not answer on ${PG_HOST}:${PG_PORT}"; exit 3; fi ;;
        -h | --help | help) usage ;;
        *) log "unknown command '${cmd}'"; usage ;;
    esac
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
