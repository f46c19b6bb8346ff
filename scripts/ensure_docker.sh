#!/usr/bin/env bash
# Make sure a Docker engine answers on this machine (docs/how-to/install.md, "From a checkout").
#
#   * engine already answers      -> report it (and which gVisor runtimes are registered, with
#                                    runsc-net's network mode); change nothing, except: when
#                                    daemon.json holds the runsc entry this script writes (we set
#                                    the engine up), add runsc-net there if the engine lacks it, or
#                                    switch runsc-net's mode when the probe below now picks the
#                                    other one, and reload dockerd (SIGHUP)
#   * not Debian, or not root     -> say what to install, exit 1
#   * Debian + root               -> apt-get install docker.io runsc (only if missing), register
#                                    runsc and runsc-net in daemon.json (merged, never clobbered),
#                                    start dockerd in the background and wait until it answers
#
# Two gVisor runtimes, one binary (docs/explanation/sandbox.md; docs/how-to/deploying.md, 1. The engine):
#   runsc      --network=none     dangerous tools: no network stack at all, only lo
#   runsc-net  --network=sandbox  dangerous tools with network.egress only: gVisor's own netstack
#                                 on the call's internal network, whose one peer is the proxy
#           or --network=host     (hostinet) only where that netstack cannot start: runsc older
#                                 than release-20240801 on a kernel where a fresh network
#                                 namespace has /proc/sys/net/core/rmem_default (it then takes
#                                 every namespace for the host's and refuses the netstack). The
#                                 sandbox's socket calls then go to the host kernel, inside the
#                                 call's own network namespace and internal network
#
# Overrides (mostly for tests):
#   TOOLREG_DOCKER_JSON   daemon.json path        (default /etc/docker/daemon.json)
#   TOOLREG_DOCKERD_LOG   dockerd log file        (default /var/log/toolreg-dockerd.log)
#   TOOLREG_DOCKER_WAIT   seconds to wait for it  (default 60)
#   TOOLREG_DOCKER_PIDFILE  dockerd's pid file    (default /var/run/docker.pid)
#   TOOLREG_CONTAINERD_PIDFILE  containerd's      (default /var/run/docker/containerd/containerd.pid)
#   TOOLREG_RUNSC_VERSION what `runsc --version` says     (default: asked)
#   TOOLREG_NETNS_RMEM    yes|no: a fresh network namespace has rmem_default (default: probed
#                         with `unshare -n`)
#
# The script can be sourced; it then only defines its functions (e.g. merge_daemon_json).
set -euo pipefail

DOCKER_JSON="${TOOLREG_DOCKER_JSON:-/etc/docker/daemon.json}"
DOCKERD_LOG="${TOOLREG_DOCKERD_LOG:-/var/log/toolreg-dockerd.log}"
DOCKER_WAIT="${TOOLREG_DOCKER_WAIT:-60}"
DOCKER_PIDFILE="${TOOLREG_DOCKER_PIDFILE:-/var/run/docker.pid}"
# dockerd (not run as a service) starts its own containerd and keeps its pid here.
CONTAINERD_PIDFILE="${TOOLREG_CONTAINERD_PIDFILE:-/var/run/docker/containerd/containerd.pid}"
PACKAGES=(docker.io runsc)
# The runtime names the server looks for (sandbox_runner/profiles.py: GVISOR, GVISOR_NET).
GVISOR_RUNTIME=runsc
GVISOR_NET_RUNTIME=runsc-net
RELOAD_WAIT=15  # seconds for a reloaded dockerd to show a new runtime
# Older runsc builds take a network namespace for the host's when it has
# /proc/sys/net/core/rmem_default, which every namespace has on newer kernels (6.18 here);
# they then refuse --network=sandbox. gVisor fixed that check in release-20240801.
NETSTACK_FIXED_RELEASE=20240801

log() { printf 'ensure_docker: %s\n' "$*"; }
die() { printf 'ensure_docker: ERROR: %s\n' "$*" >&2; exit 1; }

docker_answers() {
    command -v docker >/dev/null 2>&1 && timeout 15 docker info >/dev/null 2>&1
}

# True when the engine offers the runtime NAME (a key of `docker info`'s Runtimes).
runtime_registered() {
    timeout 15 docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q "\"$1\":"
}

# The --network value (sandbox, host, none, ...) the engine runs runsc-net with, read from
# the runtimeArgs `docker info` reports (runsc's default, sandbox, when they name none);
# nothing when the engine lacks runsc-net.
registered_network() {
    local runtimes
    runtimes="$(timeout 15 docker info --format '{{json .Runtimes}}' 2>/dev/null)" || return 0
    python3 - "$GVISOR_NET_RUNTIME" "$runtimes" <<'PY' 2>/dev/null || true
import json, sys

try:
    entry = json.loads(sys.argv[2]).get(sys.argv[1])
except (ValueError, AttributeError):
    entry = None
if isinstance(entry, dict):
    args, network = [str(a) for a in entry.get("runtimeArgs") or []], "sandbox"
    for i, arg in enumerate(args):  # Go's flags: -network=X, --network=X, -network X; last wins
        name, eq, value = arg.lstrip("-").partition("=")
        if arg.startswith("-") and name == "network":
            network = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    print(network)
PY
}

# gVisor's network mode under a runsc --network value: netstack, hostinet, or the value.
network_mode() {
    case "$1" in
        sandbox) echo netstack ;;
        host) echo hostinet ;;
        *) echo "$1" ;;
    esac
}

report_running() {
    local server runsc=no runsc_net=no network
    server="$(timeout 15 docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?')"
    runtime_registered "$GVISOR_RUNTIME" && runsc=yes
    network="$(registered_network)"
    [[ -z "$network" ]] || runsc_net="yes: $(network_mode "$network") (--network=${network})"
    log "Docker engine ${server} already running (runtimes registered: ${GVISOR_RUNTIME} ${runsc}," \
        "${GVISOR_NET_RUNTIME} ${runsc_net})"
}

# shellcheck source=../sandbox_runner/images/debian.sh
source "$(dirname "${BASH_SOURCE[0]}")/../sandbox_runner/images/debian.sh"

# "yes" when a fresh network namespace has /proc/sys/net/core/rmem_default (what old runsc
# builds take for the host's namespace), "no" when not, nothing when this process cannot
# make one (not root, no unshare).
fresh_netns_has_rmem_default() {
    if [[ -n "${TOOLREG_NETNS_RMEM:-}" ]]; then
        echo "$TOOLREG_NETNS_RMEM"
        return 0
    fi
    command -v unshare >/dev/null 2>&1 || return 0
    # /proc/sys/net shows the network namespace of the process that reads it.
    unshare -n sh -c 'if [ -e /proc/sys/net/core/rmem_default ]; then echo yes; else echo no; fi' \
        2>/dev/null || true
}

# The release date (YYYYMMDD) of the runsc at PATH, from `runsc --version` ("runsc version
# release-20240807.0"; Debian's: "runsc version 0.0~20221219.0"); nothing when it names none.
runsc_release() {
    local said="${TOOLREG_RUNSC_VERSION:-}"
    [[ -n "$said" ]] || said="$("$1" --version 2>/dev/null | head -n 1 || true)"
    grep -oE '20[0-9]{6}' <<<"$said" | head -n 1 || true
}

# Pick runsc-net's --network for the runsc at PATH: sandbox (gVisor's netstack, preferred),
# or host (hostinet) only when this runsc is older than NETSTACK_FIXED_RELEASE and a fresh
# network namespace has rmem_default, so that its netstack cannot start here. Sets
# RUNSC_NET_NETWORK, and RUNSC_NET_WHY: the log line that says which and why.
pick_runsc_net_network() {
    local release rmem
    release="$(runsc_release "$1")"
    RUNSC_NET_NETWORK=sandbox
    RUNSC_NET_WHY="${GVISOR_NET_RUNTIME}: gVisor's netstack (--network=sandbox)"
    if [[ -z "$release" ]]; then
        RUNSC_NET_WHY+="; $1 --version names no release"
        return 0
    fi
    if ((release >= NETSTACK_FIXED_RELEASE)); then
        RUNSC_NET_WHY+="; runsc ${release}"
        return 0
    fi
    rmem="$(fresh_netns_has_rmem_default)"
    if [[ "$rmem" != yes ]]; then
        RUNSC_NET_WHY+="; runsc ${release}, and a fresh network namespace"
        RUNSC_NET_WHY+="$([[ "$rmem" == no ]] && echo " has no rmem_default" || echo ": not probed")"
        return 0
    fi
    RUNSC_NET_NETWORK=host
    RUNSC_NET_WHY="WARNING: ${GVISOR_NET_RUNTIME} uses hostinet (--network=host), not gVisor's"
    RUNSC_NET_WHY+=" netstack: runsc ${release} is older than release-${NETSTACK_FIXED_RELEASE}"
    RUNSC_NET_WHY+=" and takes every network namespace for the host's on this kernel (a fresh"
    RUNSC_NET_WHY+=" one has /proc/sys/net/core/rmem_default), so its netstack cannot start; the"
    RUNSC_NET_WHY+=" sandbox's socket calls go to the host kernel, inside the call's own"
    RUNSC_NET_WHY+=" namespace and internal network. Fix: install runsc from gVisor"
    RUNSC_NET_WHY+=" release-${NETSTACK_FIXED_RELEASE} or later and run this script again"
    RUNSC_NET_WHY+=" (docs/how-to/deploying.md, 1. The engine)"
}

# Merge both gVisor runtimes into daemon.json, keeping every other key (and every other
# runtime):
#   {"runtimes": {"runsc":     {"path": RUNSC, "runtimeArgs": ["--network=none"]},
#                 "runsc-net": {"path": RUNSC, "runtimeArgs": ["--network=NETWORK"]}}}
# NETWORK, the third argument: sandbox (the default) or host (pick_runsc_net_network).
# Prints "changed" or "unchanged". Refuses to touch a file that is not a JSON object
# (better than silently dropping someone's settings).
merge_daemon_json() {
    local file="$1" runsc_path="$2" network="${3:-sandbox}"
    command -v python3 >/dev/null 2>&1 || die "python3 is needed to edit ${file}"
    [[ "$network" == sandbox || "$network" == host ]] || die "no runsc-net network '${network}'"
    mkdir -p "$(dirname "$file")"
    python3 - "$file" "$runsc_path" "$GVISOR_RUNTIME" "$GVISOR_NET_RUNTIME" "$network" <<'PY'
import json, os, sys

path, runsc, plain, networked, network = sys.argv[1:6]
wanted = {
    plain: {"path": runsc, "runtimeArgs": ["--network=none"]},
    # sandbox: gVisor's own network stack (netstack) on the container's interfaces, so
    # the sandbox talks to the host kernel's network only through it. host (hostinet):
    # its socket calls go to the host kernel, inside the container's own namespace.
    # Either way the call's internal Docker network decides where packets can go.
    networked: {"path": runsc, "runtimeArgs": [f"--network={network}"]},
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

# What of daemon.json is this script's to change: "RUNSC NET" when its runsc entry is
# exactly as merge_daemon_json writes it (so this script set the engine up), NET saying
# what its runsc-net entry is: absent; sandbox or host (as merge_daemon_json writes it,
# same path); other (someone else's). Nothing when the runsc entry is not ours.
owned_entries() {
    local file="$1"
    [[ -f "$file" ]] || return 0
    python3 - "$file" "$GVISOR_RUNTIME" "$GVISOR_NET_RUNTIME" <<'PY' 2>/dev/null || true
import json, os, sys

with open(sys.argv[1], encoding="utf-8") as fh:
    runtimes = json.load(fh).get("runtimes", {})
entry, net = runtimes.get(sys.argv[2]), runtimes.get(sys.argv[3])
if (
    isinstance(entry, dict)
    and set(entry) == {"path", "runtimeArgs"}
    and entry["runtimeArgs"] == ["--network=none"]
    and isinstance(entry["path"], str)
    and entry["path"].startswith("/")
    and not any(c.isspace() for c in entry["path"])
    and os.access(entry["path"], os.X_OK)
):
    state = "absent" if net is None else "other"
    for network in ("sandbox", "host"):
        if net == {"path": entry["path"], "runtimeArgs": [f"--network={network}"]}:
            state = network
    print(entry["path"], state)
PY
}

# Poll until the engine offers the runtime NAME (a reload is asynchronous) and, given
# NETWORK, runs runsc-net with that --network.
wait_for_runtime() {
    local name="$1" network="${2:-}" polls=0
    # every 0.2 s: a reload usually shows within a fraction of a second
    until runtime_registered "$name" && [[ -z "$network" || "$(registered_network)" == "$network" ]]; do
        ((polls >= RELOAD_WAIT * 5)) && return 1
        sleep 0.2
        polls=$((polls + 1))
    done
}

# An engine that answers and has runsc: when we set it up (daemon.json holds our runsc
# entry), run as root and its dockerd is the one in DOCKER_PIDFILE, give it the runsc-net
# that pick_runsc_net_network picks now (added when missing; its mode switched when the
# entry is ours and has the other one) and reload dockerd. SIGHUP reloads "runtimes"
# without stopping a container (moby daemon/reload_unix.go, reloadPlatform). Any other
# engine is the operator's: say what is missing, change nothing.
update_running_engine() {
    runtime_registered "$GVISOR_RUNTIME" || return 0 # no gVisor at all: nothing of ours
    local owned="" runsc="" state="" registered pid
    [[ "$(id -u)" == 0 ]] && owned="$(owned_entries "$DOCKER_JSON")"
    registered="$(registered_network)"
    if [[ -z "$owned" ]] || ! pidfile_alive "$DOCKER_PIDFILE" dockerd; then
        if [[ -z "$registered" ]]; then
            log "WARNING: runtime ${GVISOR_NET_RUNTIME} is not registered, so dangerous tools with" \
                "egress will be refused; register it as docs/how-to/deploying.md (1. The engine) shows"
        fi
        return 0
    fi
    read -r runsc state <<<"$owned"
    # Someone else's runsc-net (in daemon.json, or registered otherwise): theirs to change.
    [[ "$state" != other && ! ("$state" == absent && -n "$registered") ]] || return 0
    pick_runsc_net_network "$runsc"
    log "$RUNSC_NET_WHY"
    [[ "$state" != "$RUNSC_NET_NETWORK" || "$registered" != "$RUNSC_NET_NETWORK" ]] || return 0
    log "${GVISOR_NET_RUNTIME} runtime in ${DOCKER_JSON}:" \
        "$(merge_daemon_json "$DOCKER_JSON" "$runsc" "$RUNSC_NET_NETWORK")"
    pid="$(tr -dc '0-9' <"$DOCKER_PIDFILE")"
    log "reloading dockerd (SIGHUP to ${pid}) to pick up ${GVISOR_NET_RUNTIME}" \
        "with --network=${RUNSC_NET_NETWORK}"
    kill -HUP "$pid"
    if wait_for_runtime "$GVISOR_NET_RUNTIME" "$RUNSC_NET_NETWORK"; then
        log "${GVISOR_NET_RUNTIME} runtime registered: $(network_mode "$RUNSC_NET_NETWORK")"
    else
        log "WARNING: dockerd did not pick up ${GVISOR_NET_RUNTIME} with" \
            "--network=${RUNSC_NET_NETWORK} within ${RELOAD_WAIT}s (does it read ${DOCKER_JSON}?);" \
            "restart it to use dangerous tools with egress"
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
        update_running_engine
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
    "runsc-net" with runtimeArgs ["--network=sandbox"] (dangerous tools with egress; a runsc
    older than release-20240801 may need ["--network=host"]: docs/how-to/deploying.md).
EOF
        exit 1
    fi

    apt_install "${PACKAGES[@]}"

    local runsc changed=unchanged
    runsc="$(command -v runsc || true)"
    if [[ -n "$runsc" ]]; then
        pick_runsc_net_network "$runsc"
        log "$RUNSC_NET_WHY"
        changed="$(merge_daemon_json "$DOCKER_JSON" "$runsc" "$RUNSC_NET_NETWORK")"
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
    if wait_for_runtime "$GVISOR_RUNTIME"; then
        log "${GVISOR_RUNTIME} runtime registered"
    else
        log "WARNING: ${GVISOR_RUNTIME} runtime not registered"
    fi
    if wait_for_runtime "$GVISOR_NET_RUNTIME" "$RUNSC_NET_NETWORK"; then
        log "${GVISOR_NET_RUNTIME} runtime registered: $(network_mode "$RUNSC_NET_NETWORK")"
    else
        log "WARNING: ${GVISOR_NET_RUNTIME} runtime not registered with --network=${RUNSC_NET_NETWORK}"
    fi
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
