# Sourced by .ci/run, .ci/verl_env.sh and .ci/frameworks_env.sh: one way to install packages.
#
#   ci_install PYTHON PIP-INSTALL-ARGUMENTS...
#
# installs into PYTHON's environment with uv (`uv pip install`) when $SPANRL_CI_UV names a uv
# binary (.ci/run installs uv into .venv and sets it), else with that environment's pip. uv gives
# the same versions as pip here (the two environments' `pip freeze` compared equal) in a fraction
# of the CPU time: the main install took 7-11 s against ~45 s, which matters because the later
# environments build beside the main suite. uv reads no pip configuration, so pip's find-links
# ($PIP_FIND_LINKS: where this machine's CPU build of torch lies) are passed on, and pip's rule of
# taking the best version from any index is asked for. Should uv fail, pip runs the same install.
ci_install() {
    local python=$1
    shift
    if [ -n "${SPANRL_CI_UV:-}" ]; then
        local links=() link
        for link in ${PIP_FIND_LINKS:-}; do
            links+=(--find-links "$link")
        done
        local certificates=${SSL_CERT_FILE:-${PIP_CERT:-}}  # pip's certificate bundle, if it has one
        if env ${certificates:+SSL_CERT_FILE="$certificates"} "$SPANRL_CI_UV" pip install --quiet \
            --python "$python" --index-strategy unsafe-best-match "${links[@]}" "$@"; then
            return 0
        fi
        echo "ci_install: uv failed; the same install with pip" >&2
    fi
    "$python" -m pip install -q "$@"
}
