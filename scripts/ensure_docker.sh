#!/usr/bin/env bash
# Make sure a Docker engine answers on this machine (README: Two commands).
#
#   * engine already answers      -> report it (and whether runsc is registered), change nothing
#   * not Debian, or not root     -> say what to install, exit 1
#   * Debian + root               -> apt-get install docker.io runsc (only if missing), register
#                                    runsc in daemon.json (merged, never clobbered), start dockerd
#                                    in the background and wait until it answers
#
# Overrides (mostly for tests):
#   TOOLREG_DOCKER_JSON   daemon.json path        (default /etc/docker/daemon.json)
#   TOOLREG_DOCKERD_LOG   dockerd log file        (default /var/log/toolreg-dockerd.log)
#   TOOLREG_DOCKER_WAIT   seconds to wait for it  (default 60)
#
# The script can be sourced; it then only defines its functions (e.g. merge_daemon_json).
set -euo pipefail

DOCKER_JSON="${TOOLREG_DOCKER_JSON:-/etc/docker/daemon.json}"
DOCKERD_LOG="${TOOLREG_DOCKERD_LOG:-/var/log/toolreg-dockerd.log}"
DOCKER_WAIT="${TOOLREG_DOCKER_WAIT:-60}"
DOCKER_PIDFILE=/var/run/docker.pid
# dockerd (not run as a service) starts its own containerd and keeps its pid here.
CONTAINERD_PIDFILE=/var/run/docker/containerd/containerd.pid
PACKAGES=(docker.io runsc)

log() { printf 'ensure_docker: %s\n' "$*"; }
die() { printf 'ensure_docker: ERROR: %s\n' "$*" >&2; exit 1; }

docker_answers() {
    command -v docker >/dev/null 2>&1 && timeout 15 docker info >/dev/null 2>&1
}

runsc_registered() {
    timeout 15 docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"'
}

report_running() {
    local server runsc=no
    server="$(timeout 15 docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?')"
    runsc_registered && runsc=yes
    log "Docker engine ${server} already running (runsc runtime registered: ${runsc}); nothing changed"
}

# shellcheck source=debian.sh
source "$(dirname "${BASH_SOURCE[0]}")/debian.sh"

# Merge {"runtimes": {"runsc": {"path": RUNSC, "runtimeArgs": ["--network=none"]}}} into
# daemon.json, keeping every other key. Prints "changed" or "unchanged". Refuses to touch a
# file that is not a JSON object (better than silently dropping someone's settings).
merge_daemon_json() {
    local file="$1" runsc_path="$2"
    command -v python3 >/dev/null 2>&1 || die "python3 is needed to edit ${file}"
    mkdir -p "$(dirname "$file")"
    python3 - "$file" "$runsc_path" <<'PY'
import json, os, sys

path, runsc = sys.argv[1], sys.argv[2]
wanted = {"path": runsc, "runtimeArgs": ["--network=none"]}
config = {}
if os.path.exists(path):
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if text.strip():
        try:
            config = json.loads(text)
        except ValueError as exc:
            sys.exit(f"ensure_docker: ERROR: {path} is not valid JSON ({exc}); fix it by hand")
    if not isinstance(config, dict):
        sys.exit(f"ensure_docker: ERROR: {path} is not a JSON object; fix it by hand")
runtimes = config.setdefault("runtimes", {})
if not isinstance(runtimes, dict):
    sys.exit(f"ensure_docker: ERROR: 'runtimes' in {path} is not an object; fix it by hand")
if runtimes.get("runsc") == wanted:
    print("unchanged")
    sys.exit(0)
runtimes["runsc"] = wanted
tmp = f"{path}.toolreg.tmp"
with open(tmp, "w", encoding="utf-8") as fh:
    json.dump(config, fh, indent=2)
    fh.write("\n")
os.replace(tmp, path)  # atomic: a concurrent dockerd start never sees half a file
print("changed")
PY
}

# True when the pid in FILE is a live process whose command name is NAME.
pidfile_alive() {
    local file="$1" name="$2" pid
    [[ -s "$file" ]] || return 1
    pid="$(tr -dc '0-9' <"$file")"
    [[ -n "$pid" && -d "/proc/$pid" ]] || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$name" ]]
}

# A killed daemon leaves its pid files behind; a reused pid would make dockerd refuse to start.
clear_stale_pidfiles() {
    if [[ -e "$DOCKER_PIDFILE" ]] && ! pidfile_alive "$DOCKER_PIDFILE" dockerd; then
        log "removing stale ${DOCKER_PIDFILE}"
        rm -f "$DOCKER_PIDFILE"
    fi
    if [[ -e "$CONTAINERD_PIDFILE" ]] && ! pidfile_alive "$CONTAINERD_PIDFILE" containerd; then
        log "removing stale ${CONTAINERD_PIDFILE}"
        rm -f "$CONTAINERD_PIDFILE"
    fi
}

start_dockerd() {
    local dockerd
    dockerd="$(command -v dockerd || echo /usr/sbin/dockerd)"
    [[ -x "$dockerd" ]] || die "dockerd not found after installing docker.io"
    mkdir -p "$(dirname "$DOCKERD_LOG")"
    log "starting ${dockerd} in the background (log: ${DOCKERD_LOG})"
    # setsid + nohup: the daemon must outlive the shell/make that started it.
    setsid nohup "$dockerd" >>"$DOCKERD_LOG" 2>&1 </dev/null &
    disown || true
}

wait_for_docker() {
    local waited=0
    while ! docker_answers; do
        if ((waited >= DOCKER_WAIT)); then
            log "Docker did not answer within ${DOCKER_WAIT}s; last lines of ${DOCKERD_LOG}:" >&2
            tail -n 25 "$DOCKERD_LOG" >&2 2>/dev/null || true
            die "the Docker engine did not come up; see ${DOCKERD_LOG}"
        fi
        if ((waited % 5 == 0)); then log "waiting for dockerd ... (${waited}s)"; fi
        sleep 1
        waited=$((waited + 1))
    done
    log "Docker engine answers after ${waited}s"
}

main() {
    if docker_answers; then
        report_running
        return 0
    fi

    if ! is_debian || [[ "$(id -u)" != 0 ]]; then
        cat >&2 <<'EOF'
ensure_docker: ERROR: no Docker engine answers (`docker info` failed), and this script can only
install one on Debian as root. Please install and start:
  * a Docker engine (Debian/Ubuntu: `apt-get install docker.io`; elsewhere Docker Engine
    from https://docs.docker.com/engine/install/), and make sure your user may use it;
  * optionally gVisor (`runsc`, https://gvisor.dev/docs/user_guide/install/) registered as a
    Docker runtime named "runsc" with runtimeArgs ["--network=none"] (used for dangerous tools).
EOF
        exit 1
    fi

    apt_install "${PACKAGES[@]}"

    local runsc changed=unchanged
    runsc="$(command -v runsc || true)"
    if [[ -n "$runsc" ]]; then
        changed="$(merge_daemon_json "$DOCKER_JSON" "$runsc")"
        log "runsc runtime in ${DOCKER_JSON}: ${changed}"
    else
        log "WARNING: runsc not found; dangerous tools will fall back to runc"
    fi

    # The package's init script may already have started the daemon during install.
    if pidfile_alive "$DOCKER_PIDFILE" dockerd; then
        if [[ "$changed" == changed ]]; then
            log "dockerd already running: reloading it (SIGHUP) to pick up the runsc runtime"
            kill -HUP "$(tr -dc '0-9' <"$DOCKER_PIDFILE")"
        fi
        log "dockerd already running; waiting for it to answer"
    else
        clear_stale_pidfiles
        start_dockerd
    fi
    wait_for_docker
    if runsc_registered; then
        log "runsc runtime registered"
    else
        log "WARNING: runsc runtime not registered"
    fi
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
