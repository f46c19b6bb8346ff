#!/usr/bin/env bash
# Make sure a Docker engine answers on this machine (README: Two commands).
#
#   * engine already answers      -> report it (and which gVisor runtimes are registered); change
#                                    nothing, except: when daemon.json holds the runsc entry this
#                                    script writes (we set the engine up) but the engine lacks
#                                    runsc-net, add runsc-net there and reload dockerd (SIGHUP)
#   * not Debian, or not root     -> say what to install, exit 1
#   * Debian + root               -> apt-get install docker.io runsc (only if missing), register
#                                    runsc and runsc-net in daemon.json (merged, never clobbered),
#                                    start dockerd in the background and wait until it answers
#
# Two gVisor runtimes, one binary (README: The sandbox; docs/deploying.md, 1. The engine):
#   runsc      --network=none     dangerous tools: no network stack at all, only lo
#   runsc-net  --network=sandbox  dangerous tools with network.egress only: gVisor's own netstack
#                                 on the call's internal network, whose one peer is the proxy
#
# Overrides (mostly for tests):
#   TOOLREG_DOCKER_JSON   daemon.json path        (default /etc/docker/daemon.json)
#   TOOLREG_DOCKERD_LOG   dockerd log file        (default /var/log/toolreg-dockerd.log)
#   TOOLREG_DOCKER_WAIT   seconds to wait for it  (default 60)
#   TOOLREG_DOCKER_PIDFILE  dockerd's pid file    (default /var/run/docker.pid)
#
# The script can be sourced; it then only defines its functions (e.g. merge_daemon_json).
set -euo pipefail

DOCKER_JSON="${TOOLREG_DOCKER_JSON:-/etc/docker/daemon.json}"
DOCKERD_LOG="${TOOLREG_DOCKERD_LOG:-/var/log/toolreg-dockerd.log}"
DOCKER_WAIT="${TOOLREG_DOCKER_WAIT:-60}"
DOCKER_PIDFILE="${TOOLREG_DOCKER_PIDFILE:-/var/run/docker.pid}"
# dockerd (not run as a service) starts its own containerd and keeps its pid here.
CONTAINERD_PIDFILE=/var/run/docker/containerd/containerd.pid
PACKAGES=(docker.io runsc)
# The runtime names the server looks for (sandbox_runner/profiles.py: GVISOR, GVISOR_NET).
GVISOR_RUNTIME=runsc
GVISOR_NET_RUNTIME=runsc-net
RELOAD_WAIT=15  # seconds for a reloaded dockerd to show a new runtime

log() { printf 'ensure_docker: %s\n' "$*"; }
die() { printf 'ensure_docker: ERROR: %s\n' "$*" >&2; exit 1; }

docker_answers() {
    command -v docker >/dev/null 2>&1 && timeout 15 docker info >/dev/null 2>&1
}

# True when the engine offers the runtime NAME (a key of `docker info`'s Runtimes).
runtime_registered() {
    timeout 15 docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q "\"$1\":"
}

report_running() {
    local server runsc=no runsc_net=no
    server="$(timeout 15 docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?')"
    runtime_registered "$GVISOR_RUNTIME" && runsc=yes
    runtime_registered "$GVISOR_NET_RUNTIME" && runsc_net=yes
    log "Docker engine ${server} already running (runtimes registered: ${GVISOR_RUNTIME} ${runsc}," \
        "${GVISOR_NET_RUNTIME} ${runsc_net})"
}

# shellcheck source=debian.sh
source "$(dirname "${BASH_SOURCE[0]}")/debian.sh"

# Merge both gVisor runtimes into daemon.json, keeping every other key (and every other
# runtime):
#   {"runtimes": {"runsc":     {"path": RUNSC, "runtimeArgs": ["--network=none"]},
#                 "runsc-net": {"path": RUNSC, "runtimeArgs": ["--network=sandbox"]}}}
# Prints "changed" or "unchanged". Refuses to touch a file that is not a JSON object
# (better than silently dropping someone's settings).
merge_daemon_json() {
    local file="$1" runsc_path="$2"
    command -v python3 >/dev/null 2>&1 || die "python3 is needed to edit ${file}"
    mkdir -p "$(dirname "$file")"
    python3 - "$file" "$runsc_path" "$GVISOR_RUNTIME" "$GVISOR_NET_RUNTIME" <<'PY'
import json, os, sys

path, runsc, plain, networked = sys.argv[1:5]
wanted = {
    plain: {"path": runsc, "runtimeArgs": ["--network=none"]},
    # gVisor's own network stack (netstack) on the container's interfaces: the sandbox
    # talks to the host kernel's network only through it, and Docker's network (the
    # call's internal one) decides where packets can go.
    networked: {"path": runsc, "runtimeArgs": ["--network=sandbox"]},
}
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
if all(runtimes.get(name) == entry for name, entry in wanted.items()):
    print("unchanged")
    sys.exit(0)
runtimes.update(wanted)
tmp = f"{path}.toolreg.tmp"
with open(tmp, "w", encoding="utf-8") as fh:
    json.dump(config, fh, indent=2)
    fh.write("\n")
os.replace(tmp, path)  # atomic: a concurrent dockerd start never sees half a file
print("changed")
PY
}

# The runsc path of daemon.json's runsc entry when it is exactly as merge_daemon_json
# writes it (so this script set the engine up and may add to it), else nothing.
owned_runsc_path() {
    local file="$1"
    [[ -f "$file" ]] || return 0
    python3 - "$file" "$GVISOR_RUNTIME" <<'PY' 2>/dev/null || true
import json, os, sys

with open(sys.argv[1], encoding="utf-8") as fh:
    entry = json.load(fh).get("runtimes", {}).get(sys.argv[2])
if (
    isinstance(entry, dict)
    and set(entry) == {"path", "runtimeArgs"}
    and entry["runtimeArgs"] == ["--network=none"]
    and isinstance(entry["path"], str)
    and os.access(entry["path"], os.X_OK)
):
    print(entry["path"])
PY
}

# Poll until the engine offers the runtime NAME (a reload is asynchronous).
wait_for_runtime() {
    local name="$1" waited=0
    until runtime_registered "$name"; do
        ((waited >= RELOAD_WAIT)) && return 1
        sleep 1
        waited=$((waited + 1))
    done
}

# An engine that answers but lacks runsc-net (set up before it existed): when we set it up
# (daemon.json holds our runsc entry) and run as root, add runsc-net and reload dockerd.
# SIGHUP reloads "runtimes" without stopping a container (moby daemon/reload_unix.go,
# reloadPlatform). Any other engine is the operator's: say what is missing, change nothing.
add_net_runtime_to_running_engine() {
    runtime_registered "$GVISOR_NET_RUNTIME" && return 0
    runtime_registered "$GVISOR_RUNTIME" || return 0  # no gVisor at all: nothing of ours
    local runsc="" pid
    [[ "$(id -u)" == 0 ]] && runsc="$(owned_runsc_path "$DOCKER_JSON")"
    if [[ -z "$runsc" ]] || ! pidfile_alive "$DOCKER_PIDFILE" dockerd; then
        log "WARNING: runtime ${GVISOR_NET_RUNTIME} is not registered, so dangerous tools with" \
            "egress will be refused; register it as docs/deploying.md (1. The engine) shows"
        return 0
    fi
    log "${GVISOR_NET_RUNTIME} runtime in ${DOCKER_JSON}: $(merge_daemon_json "$DOCKER_JSON" "$runsc")"
    pid="$(tr -dc '0-9' <"$DOCKER_PIDFILE")"
    log "reloading dockerd (SIGHUP to ${pid}) to pick up ${GVISOR_NET_RUNTIME}"
    kill -HUP "$pid"
    if wait_for_runtime "$GVISOR_NET_RUNTIME"; then
        log "${GVISOR_NET_RUNTIME} runtime registered"
    else
        log "WARNING: dockerd did not pick up ${GVISOR_NET_RUNTIME} within ${RELOAD_WAIT}s" \
            "(does it read ${DOCKER_JSON}?); restart it to use dangerous tools with egress"
    fi
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
        add_net_runtime_to_running_engine
        return 0
    fi

    if ! is_debian || [[ "$(id -u)" != 0 ]]; then
        cat >&2 <<'EOF'
ensure_docker: ERROR: no Docker engine answers (`docker info` failed), and this script can only
install one on Debian as root. Please install and start:
  * a Docker engine (Debian/Ubuntu: `apt-get install docker.io`; elsewhere Docker Engine
    from https://docs.docker.com/engine/install/), and make sure your user may use it;
  * optionally gVisor (`runsc`, https://gvisor.dev/docs/user_guide/install/) registered as two
    Docker runtimes: "runsc" with runtimeArgs ["--network=none"] (dangerous tools) and
    "runsc-net" with runtimeArgs ["--network=sandbox"] (dangerous tools with egress).
EOF
        exit 1
    fi

    apt_install "${PACKAGES[@]}"

    local runsc changed=unchanged
    runsc="$(command -v runsc || true)"
    if [[ -n "$runsc" ]]; then
        changed="$(merge_daemon_json "$DOCKER_JSON" "$runsc")"
        log "${GVISOR_RUNTIME} and ${GVISOR_NET_RUNTIME} runtimes in ${DOCKER_JSON}: ${changed}"
    else
        log "WARNING: runsc not found; dangerous tools will be refused (development mode runs" \
            "those without egress under runc)"
    fi

    # The package's init script may already have started the daemon during install.
    if pidfile_alive "$DOCKER_PIDFILE" dockerd; then
        if [[ "$changed" == changed ]]; then
            log "dockerd already running: reloading it (SIGHUP) to pick up the gVisor runtimes"
            kill -HUP "$(tr -dc '0-9' <"$DOCKER_PIDFILE")"
        fi
        log "dockerd already running; waiting for it to answer"
    else
        clear_stale_pidfiles
        start_dockerd
    fi
    wait_for_docker
    [[ -n "$runsc" ]] || return 0
    local name
    for name in "$GVISOR_RUNTIME" "$GVISOR_NET_RUNTIME"; do
        if wait_for_runtime "$name"; then
            log "${name} runtime registered"
        else
            log "WARNING: ${name} runtime not registered"
        fi
    done
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
