# Sourced by each .ci/install-* script: "$sudo" before a command runs it as root. Nothing when
# root already, sudo where it exists; a user without sudo (a plain Debian has none) gets one line
# saying what to run as root instead of "sudo: command not found".
sudo=""
if [ "$EUID" -ne 0 ]; then
    if ! command -v sudo >/dev/null; then
        echo "$0 installs Debian packages, which needs root, and there is no sudo here: as root, run: bash $0" >&2
        exit 1
    fi
    sudo="sudo"
fi
