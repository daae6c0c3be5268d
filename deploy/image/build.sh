#!/usr/bin/env bash
# The service's OCI image, built with no registry (`make image`; docs/deploying.rst, "In a container").
#
#   1. a Debian bookworm root filesystem from debootstrap (minbase and python3, with bookworm's
#      security and point updates), kept as a tarball under var/image/ keyed on the list below:
#      the next build of the same list starts from it (and gets the same Debian versions);
#   2. the wheel of the commit HEAD (from `git archive`, so an uncommitted change is not in it) and
#      the wheels of deploy/requirements.txt, fetched by this checkout's pip (.venv);
#   3. `buildah from scratch`: the root filesystem, trimmed (no apt lists or caches, docs, man pages
#      or locales), a venv at /opt/petstore/venv made by the image's own python3 and filled by pip
#      (this checkout's, run by that python3; no index, no cache, no compiler), the user petstore
#      (10001:10001), deploy/gunicorn.conf.py, the Debian versions in debian-packages.txt; then
#      the config (user, working directory, environment, command, stop signal, port) and a commit.
#
# Usage: bash deploy/image/build.sh NAME:TAG [NAME:TAG...]   (as root; .ci/install-podman first)
# PIP: the pip command that fetches and builds the wheels (default: .venv/bin/python -m pip).
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ "$#" -eq 0 ]; then
    echo "usage: $0 NAME:TAG [NAME:TAG...]" >&2
    exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "$0: builds as root (debootstrap, buildah's storage): run it, or make image, as root" >&2
    exit 1
fi
export PATH="$PATH:/usr/sbin:/sbin"
for program in buildah debootstrap git; do
    if ! command -v "$program" >/dev/null; then
        echo "$0: $program is missing: run bash .ci/install-podman (as root)" >&2
        exit 1
    fi
done

suite=bookworm
mirror=http://deb.debian.org/debian
security=http://deb.debian.org/debian-security
packages=python3
uid=10001
home=/opt/petstore
pip=${PIP:-.venv/bin/python -m pip}
commit=$(git rev-parse HEAD)
version=$(sed -n 's/^version = //p' setup.cfg)

var=var/image
work=$var/work
# buildah's and debootstrap's temporary files: under var/, never in /tmp.
export TMPDIR=$PWD/$var/tmp
rm -rf "$work" "$TMPDIR"
mkdir -p "$work" "$TMPDIR"

container=""
cleanup() {
    if [ -n "$container" ]; then
        buildah rm "$container" >/dev/null || true
    fi
    rm -rf "$work" "$TMPDIR"
}
trap cleanup EXIT

echo "== 1. the root filesystem: Debian $suite, minbase and $packages"
sources="deb $mirror $suite main
deb $mirror $suite-updates main
deb $security $suite-security main"
key=$(printf '%s\n' "$suite" "$packages" "$sources" | sha256sum | cut -c1-16)
rootfs_tar=$var/rootfs-$suite-$key.tar
if [ -f "$rootfs_tar" ]; then
    echo "kept from an earlier build: $rootfs_tar"
else
    rootfs=$work/rootfs
    debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" \
        >"$work/debootstrap.log" 2>&1 || { tail -n 20 "$work/debootstrap.log"; exit 1; }
    printf '%s\n' "$sources" >"$rootfs/etc/apt/sources.list"
    {
        chroot "$rootfs" apt-get update -q
        DEBIAN_FRONTEND=noninteractive chroot "$rootfs" apt-get upgrade -y -q
        chroot "$rootfs" apt-get clean
    } >"$work/apt.log" 2>&1 || { tail -n 20 "$work/apt.log"; exit 1; }
    rm -rf "$rootfs"/var/lib/apt/lists/*
    tar --numeric-owner -C "$rootfs" -cf "$rootfs_tar.part" .
    mv "$rootfs_tar.part" "$rootfs_tar"
    rm -rf "$rootfs"
    # Only the newest list's tarball is kept.
    find "$var" -maxdepth 1 -name 'rootfs-*.tar' ! -path "$rootfs_tar" -delete
    echo "made and kept: $rootfs_tar"
fi

echo "== 2. the wheels: petstore $version of $commit and deploy/requirements.txt"
mkdir -p "$work/src" "$work/wheels"
git archive HEAD | tar -x -C "$work/src"
$pip wheel --quiet --no-deps --wheel-dir "$work/wheels" "$work/src"
# Every pinned wheel, whatever its marker says of this python: the image's python3 decides.
sed 's/ *;.*//' deploy/requirements.txt >"$work/pins.txt"
$pip download --quiet --no-deps --only-binary=:all: --dest "$work/wheels" --requirement "$work/pins.txt"
# pip itself, for the image's python3 to run from outside the image (/build/pip).
pip_dir=$($pip show pip | sed -n 's/^Location: //p')
mkdir -p "$work/pip"
cp -r "$pip_dir/pip" "$work/pip/"

echo "== 3. the image"
container=$(buildah from --name "petstore-build-$$" scratch)
root=$(buildah mount "$container")
tar --numeric-owner -C "$root" -xf "$rootfs_tar"
# What a service never reads: documentation (each package's copyright stays), man and info pages,
# translations; and the logs of the build. dpkg is told to leave them out from now on too.
find "$root/usr/share/doc" -mindepth 1 ! -name copyright ! -type d -delete
find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
rm -rf "$root"/usr/share/{man,info,locale,lintian,linda}/* "$root"/var/log/* "$root"/var/cache/debconf/*-old
cat >"$root/etc/dpkg/dpkg.cfg.d/petstore-image" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF

in_image() {
    buildah run --isolation chroot \
        --volume "$PWD/$work/wheels:/build/wheels:ro" \
        --volume "$PWD/$work/pip:/build/pip:ro" \
        --volume "$PWD/deploy/requirements.txt:/build/requirements.txt:ro" \
        "$container" -- "$@"
}
in_image groupadd --gid "$uid" petstore
in_image useradd --uid "$uid" --gid "$uid" --home-dir "$home" --no-create-home --no-log-init \
    --shell /usr/sbin/nologin petstore
in_image python3 -m venv --without-pip "$home/venv"
# No index: every package comes from the wheels above, each pinned, none built here.
in_image env PYTHONPATH=/build/pip PIP_CONFIG_FILE=/dev/null "$home/venv/bin/python" -m pip \
    install --quiet --disable-pip-version-check --no-cache-dir --no-index --only-binary=:all: \
    --find-links /build/wheels --requirement /build/requirements.txt \
    "petstore==$version"
cp deploy/gunicorn.conf.py "$root$home/gunicorn.conf.py"
chroot "$root" dpkg-query -W -f '${Package} ${Version}\n' >"$root$home/debian-packages.txt"
rm -rf "$root/build" "$root"/var/log/*
buildah umount "$container" >/dev/null

buildah config \
    --user "$uid:$uid" \
    --workingdir "$home" \
    --env PATH="$home/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --env BIND=0.0.0.0:8000 \
    --env PYTHONUNBUFFERED=1 \
    --env PYTHONDONTWRITEBYTECODE=1 \
    --cmd '["gunicorn", "--config", "/opt/petstore/gunicorn.conf.py", "wsgi:app"]' \
    --stop-signal SIGTERM \
    --port 8000/tcp \
    --label org.opencontainers.image.title=petstore \
    --label org.opencontainers.image.version="$version" \
    --label org.opencontainers.image.revision="$commit" \
    --label org.opencontainers.image.base.name="debian:$suite (debootstrap --variant=minbase)" \
    "$container"
first=$1
buildah commit --quiet --format oci --rm "$container" "$first" >/dev/null
container=""
shift
for name in "$@"; do
    buildah tag "$first" "$name"
done
echo "built: $first $* ($(buildah images --noheading --format '{{.Size}}' "$first" | head -n 1) uncompressed)"
