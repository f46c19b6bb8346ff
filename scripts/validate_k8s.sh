#!/usr/bin/env bash
# Validate the Kubernetes manifests (deploy/kubernetes/*.yaml) offline, strictly, against the
# schemas of recent Kubernetes versions. Installs nothing: it needs `kubernetes-validate`
# (PyPI package kubernetes-validate, which bundles the schemas).
#
#   validate_k8s.sh [FILE...]       default: deploy/kubernetes/*.yaml
#
# Exits non-zero when any document of any file fails for any version: a schema error, an
# unknown field (--strict), a YAML error, a kind/apiVersion without a schema (a typo), or a
# file that holds no document. Not checked (the schemas do not say): value ranges such as
# port numbers, and references between objects (Secret and ConfigMap names).
#
# Overrides:
#   KUBERNETES_VALIDATE  the kubernetes-validate to run (default: on PATH, else .venv/bin/)
#   TOOLREG_K8S_VERSIONS Kubernetes versions to check against (default "1.33.0 1.37.0": the
#                        oldest the manifests support (native sidecars, preStop sleep) and a
#                        recent one; each must be bundled with the installed kubernetes-validate)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSIONS="${TOOLREG_K8S_VERSIONS:-1.33.0 1.37.0}"

log() { printf 'validate_k8s: %s\n' "$*" >&2; }
die() { printf 'validate_k8s: ERROR: %s\n' "$*" >&2; exit 1; }

find_validator() {
    if [[ -n "${KUBERNETES_VALIDATE:-}" ]]; then
        [[ -x "$KUBERNETES_VALIDATE" ]] || command -v "$KUBERNETES_VALIDATE" >/dev/null 2>&1 ||
            die "KUBERNETES_VALIDATE=${KUBERNETES_VALIDATE} is not an executable"
        printf '%s\n' "$KUBERNETES_VALIDATE"
    elif command -v kubernetes-validate >/dev/null 2>&1; then
        command -v kubernetes-validate
    elif [[ -x "${ROOT}/.venv/bin/kubernetes-validate" ]]; then
        printf '%s\n' "${ROOT}/.venv/bin/kubernetes-validate"
    else
        die "kubernetes-validate not found (on PATH or in ${ROOT}/.venv/bin); install it with
  pip install kubernetes-validate    (into .venv, or any venv and set KUBERNETES_VALIDATE=/path/to/it)"
    fi
}

main() {
    local validator files=() f v failed=0 out rc
    validator="$(find_validator)"
    if (($# > 0)); then
        files=("$@")
    else
        shopt -s nullglob
        files=("${ROOT}"/deploy/kubernetes/*.yaml)
        shopt -u nullglob
        ((${#files[@]} > 0)) || die "no manifests in ${ROOT}/deploy/kubernetes"
    fi
    for f in "${files[@]}"; do
        [[ -r "$f" ]] || die "cannot read ${f}"
        # kubernetes-validate passes a file without any document; a manifest that is empty
        # (or all comments) is a mistake here.
        grep -qE '^[[:space:]]*kind:' "$f" || { log "FAIL ${f}: no Kubernetes object in it"; failed=1; }
    done
    log "$("$validator" --version 2>&1 | head -n 1 | sed 's/^/kubernetes-validate /'), versions: ${VERSIONS}"
    # One run per file and version: a YAML error ends a run, and must not hide the other files.
    for v in $VERSIONS; do
        local bad=0
        for f in "${files[@]}"; do
            rc=0
            out="$("$validator" --strict --quiet --kubernetes-version "$v" "$f" 2>&1)" || rc=$?
            # Non-zero exit: a schema error, a YAML error or an unsupported version. WARN (no
            # schema for that kind/apiVersion, e.g. a typo in apiVersion) exits 0: a problem too.
            if grep -q '^FATAL' <<<"$out"; then
                die "$(grep -m1 '^FATAL' <<<"$out" | sed 's/^FATAL //'); set TOOLREG_K8S_VERSIONS or upgrade it"
            fi
            if ((rc != 0)) || grep -qE '^(ERROR|WARN)' <<<"$out"; then
                bad=1
                log "FAIL ${f} for Kubernetes ${v} (exit ${rc}):"
                printf '%s\n' "${out:-(no output)}" | sed 's/^/    /' >&2
            fi
        done
        if ((bad == 0)); then log "ok for Kubernetes ${v}: ${#files[@]} files"; else failed=1; fi
    done
    ((failed == 0)) || die "manifests do not validate"
    log "all manifests valid"
}

main "$@"
