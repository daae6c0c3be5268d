#!/usr/bin/env bash
# One host: each run installs this checkout as a new release beside the ones before it and serves
# it without refusing a request. Run from the checkout (after `git pull` too), as root on Debian
# with PostgreSQL on this machine:
#     apt-get install -y python3-venv postgresql curl openssl logrotate && bash deploy/install.sh
# In order:
#   1. the system user petstore: reads the releases, writes PETSTORE_STATE_DIR only;
#   2. the release PETSTORE_HOME/releases/<time>-<commit>: its own venv (this checkout's wheel and
#      its pinned dependencies) and gunicorn.conf.py; refused in one line when the user could
#      change it or cannot run its Python;
#   3. the PostgreSQL role and database (a re-run keeps the password);
#   4. the environment file (root's, readable by the user's group);
#   5. the migrations, with the new release's `petstore db upgrade`; a first key in $KEY, kept
#      beside the environment file (root's alone) while the database lists it live;
#   6. gunicorn on PETSTORE_HOME/current -> the release: started (systemd's unit where systemd is
#      PID 1, else in the background), or, when one serves already, released beside it with USR2
#      and the old master stopped only once the new one serves (docs/upgrading.rst); when the new
#      one does not, `current` points back, the old one serves on, and the script says why and
#      exits 1;
#   7. one request; the releases older than the previous one are removed.
# Settings, all optional:
#   PETSTORE_DB         name of the role and of the database (petstore)
#   PETSTORE_DB_HOST    PETSTORE_DB_PORT: where PostgreSQL listens (127.0.0.1, 5432)
#   PG_ADMIN_URL        a superuser's libpq URL (default: the postgres account, local socket)
#   BIND                gunicorn's address (127.0.0.1:8000)
#   PETSTORE_HOME       the releases and the link current (/opt/petstore)
#   PETSTORE_PYTHON     the Python the releases' venvs are made with (python3)
#   PETSTORE_ENV        the service's environment file, written here (/etc/petstore.env); the
#                       first key is kept beside it, its .env replaced by .key (/etc/petstore.key)
#   PETSTORE_STATE_DIR  gunicorn's pid file and log (/var/lib/petstore)
#   PETSTORE_USER       the system user the service runs as, created when missing (petstore)
#   PETSTORE_LOGROTATE  where the log's logrotate part goes, without systemd (/etc/logrotate.d/petstore)
set -euo pipefail
cd "$(dirname "$0")/.."

db=${PETSTORE_DB:-petstore}
db_host=${PETSTORE_DB_HOST:-127.0.0.1}
db_port=${PETSTORE_DB_PORT:-5432}
bind=${BIND:-127.0.0.1:8000}
home=${PETSTORE_HOME:-/opt/petstore}
python=${PETSTORE_PYTHON:-python3}
env_file=${PETSTORE_ENV:-/etc/petstore.env}
state=${PETSTORE_STATE_DIR:-/var/lib/petstore}
user=${PETSTORE_USER:-petstore}
pid_file=$state/gunicorn.pid
log=$state/gunicorn.log
key_file=${env_file%.env}.key
logrotate=${PETSTORE_LOGROTATE:-/etc/logrotate.d/petstore}
release=$home/releases/$(date -u +%Y%m%d-%H%M%S)-$(git rev-parse --short HEAD 2>/dev/null || echo checkout)
previous=$(readlink "$home/current" || true)
# systemd as PID 1 (sd_booted's test) runs deploy/petstore.service; elsewhere, the background.
if [ -d /run/systemd/system ]; then manager=systemd; else manager=background; fi

admin() {
    if [ -n "${PG_ADMIN_URL:-}" ]; then
        psql "$PG_ADMIN_URL" -X -q -v ON_ERROR_STOP=1 "$@"
    else
        runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 "$@"
    fi
}

# release-start: the steps of a release (docs/upgrading.rst runs them too), with the variables
# above: home, release, previous, python, env_file, state, user, bind, pid_file, log, manager.

as_user() {
    setpriv --reuid="$user" --regid="$user" --init-groups "$@"
}

refuse() {
    echo "refusing: $*" >&2
    exit 1
}

# point LINK TARGET: LINK leads to TARGET, switched in one step (a rename).
point() {
    ln -sfn "$2" "$1.new" && mv -T "$1.new" "$1"
}

# running PID: PID is a gunicorn that runs (a zombie's cmdline is empty).
running() {
    [ -n "$1" ] && grep -qs gunicorn "/proc/$1/cmdline"
}

# within SECONDS COMMAND...: wait until COMMAND succeeds; fail after SECONDS.
within() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@"; do
        [ "$SECONDS" -lt "$deadline" ] || return 1
        sleep 0.5
    done
}

# unchangeable PATH...: the user may write none of them (they are code it runs).
unchangeable() {
    local path
    for path in "$@"; do
        if as_user test -w "$path"; then
            refuse "$user may write $path, the code: make root own it"
        fi
    done
}

# build: the release's venv with this checkout's wheel and its pinned dependencies, and gunicorn's
# settings; the user may run its Python and read it, and change nothing of it.
build() {
    umask 022
    mkdir -p "$home/releases"
    unchangeable "$home" "$home/releases"
    "$python" -m venv "$release/venv"
    if ! as_user "$release/venv/bin/python" -c pass; then
        refuse "$user cannot run $release/venv/bin/python ($(realpath "$release/venv/bin/python")): make the venvs with a Python it may run (PETSTORE_PYTHON)"
    fi
    # A build/ of an earlier build would bring files this checkout no longer has into the wheel.
    rm -rf build ./*.egg-info
    "$release/venv/bin/pip" install --quiet --disable-pip-version-check .
    rm -rf build ./*.egg-info
    cp deploy/gunicorn.conf.py "$release/gunicorn.conf.py"
    unchangeable "$release" "$release/venv" "$release/venv/bin"
    if ! as_user test -r "$release/gunicorn.conf.py" -a -w "$state"; then
        refuse "$user cannot read $release or write $state: open their parents"
    fi
}

# version_of RELEASE: the version of the code RELEASE holds, which its /healthz answers.
version_of() {
    "$1/venv/bin/python" -c 'from importlib.metadata import version; print(version("petstore"))'
}

# logged: what gunicorn logged since the release or start began (its log, or the journal).
logged() {
    if [ "$manager" = systemd ]; then
        journalctl --unit petstore.service --output cat --since "@$log_since"
    else
        tail -c +"$log_from" "$log"
    fi
}

mark_log() {
    log_since=$(date +%s)
    log_from=$(($(stat -c %s "$log") + 1))
}

# serving PIDFILE: the master in PIDFILE runs, every worker of it has booted (each logs
# "Worker booted", deploy/gunicorn.conf.py), and /healthz answers the release's version.
serving() {
    local master workers worker
    master=$(cat "$1" 2>/dev/null) && running "$master" || return 1
    workers=$(cat "/proc/$master/task/$master/children" 2>/dev/null) && [ -n "$workers" ] || return 1
    for worker in $workers; do
        logged | grep -F "Worker booted (pid: $worker)" >/dev/null || return 1
    done
    curl -fsS "http://$bind/healthz" 2>/dev/null | grep -F "\"version\":\"$version\"" >/dev/null
}

# settled: the new master serves, or it has exited (its pid file goes then) or refused to start.
settled() {
    # Its pid from its pid file, or from its log line "Listening at: ... (pid)": a master whose
    # workers fail to boot may exit, its pid file gone, before the first look.
    new=${new:-$(cat "$pid_file.2" 2>/dev/null ||
        logged | sed -n 's/.*Listening at: .* (\([0-9][0-9]*\)).*/\1/p' | tail -n 1)}
    if serving "$pid_file.2"; then
        outcome=serving
    elif logged | grep "^petstore: " >/dev/null; then
        outcome="the new master refused to start"
    elif [ -n "$new" ] && ! running "$new"; then
        outcome="the new master (pid $new) exited"
    else
        return 1
    fi
}

# launch: gunicorn on current, in the background as $user, with the environment file's settings
# and nothing else (as systemd's EnvironmentFile); a release's new master reads the file again.
launch() {
    (cd "$state" && exec setsid setpriv --reuid="$user" --regid="$user" --init-groups \
        env -i PATH=/usr/local/bin:/usr/bin:/bin PETSTORE_ENV_FILE="$env_file" \
        bash -c 'set -a && . "$PETSTORE_ENV_FILE" && set +a && exec "$@"' gunicorn \
        "$home/current/venv/bin/gunicorn" --config "$home/current/gunicorn.conf.py" \
        --pid "$pid_file" wsgi:app) </dev/null >>"$log" 2>&1 &
}

# handed_over: under systemd, the new master is the unit's main process (its workers send
# MAINPID=, deploy/gunicorn.conf.py): systemd stops the whole unit when its main one exits.
handed_over() {
    [ "$manager" = systemd ] || return 0
    within 30 eval '[ "$(systemctl show --property MainPID --value petstore)" = "$new" ]' && return 0
    outcome="systemd did not take the new master (pid $new) for the unit's main process"
    return 1
}

# release: current -> $release, USR2 (a new master in the release's venv beside the old one, on
# the same socket), and TERM to the old master once the new one serves; else current back to
# $previous, the new master stopped, the old one serving on, and the reason on stderr.
release() {
    local old
    old=$(cat "$pid_file")
    version=$(version_of "$release")
    new=""
    outcome="no new master serving within 60 s"
    mark_log
    point "$home/current" "$release"
    kill -USR2 "$old"
    if within 60 settled && [ "$outcome" = serving ] && handed_over; then
        kill -TERM "$old"
        # Its running requests finish (GUNICORN_GRACEFUL_TIMEOUT); then the new master takes
        # the pid file's name.
        if within 60 eval '! running "$old"' &&
            within 10 eval '[ "$(cat "$pid_file" 2>/dev/null)" = "$new" ]'; then
            return 0
        fi
        echo "the old master (pid $old) did not stop within 60 s, or $new did not take $pid_file" >&2
        return 1
    fi
    point "$home/current" "$previous"
    new=${new:-$(cat "$pid_file.2" 2>/dev/null || true)}
    if running "$new"; then
        kill -TERM "$new"
        within 30 eval '! running "$new"' || true
    fi
    echo "the release $release does not serve: $outcome; current is $previous again, and" \
        "gunicorn (pid $old) serves it on. What was logged since, but for lines of level info:" >&2
    logged | grep -v '"level": "info"' | tail -n 20 >&2 || true
    return 1
}

# release-end

echo "== 1. the system user $user: reads the releases, writes $state only"
if ! id -u "$user" >/dev/null 2>&1; then
    useradd --system --user-group --home-dir "$state" --no-create-home \
        --shell /usr/sbin/nologin "$user"
fi
mkdir -p "$state"
touch "$log"
chown "$user:$user" "$state" "$log"
chmod 750 "$state"
# Without systemd the log is a file that grows by a line per request: logrotate keeps 14 days.
if [ "$manager" = background ]; then
    mkdir -p "$(dirname "$logrotate")"
    sed -e "s|/var/lib/petstore/gunicorn.log|$log|" -e "s|su petstore petstore|su $user $user|" \
        deploy/petstore.logrotate >"$logrotate.new"
    chmod 644 "$logrotate.new" && mv "$logrotate.new" "$logrotate"
    [ -x /usr/sbin/logrotate ] || command -v logrotate >/dev/null ||
        echo "logrotate is not installed: $log grows until it is (apt-get install logrotate)"
fi
# What serves now, if anything; refused before anything changes: a release under way, and a move
# to another address (a new master keeps the old one's socket).
old=$(cat "$pid_file" 2>/dev/null || true)
running "$old" || old=""
if running "$(cat "$pid_file.2" 2>/dev/null || true)"; then
    refuse "a release is under way ($pid_file.2): stop one of the two masters first"
fi
if [ -n "$old" ]; then
    serves_on=$(tr '\0' '\n' <"/proc/$old/environ" | sed -n 's/^BIND=//p')
    if [ "$serves_on" != "$bind" ]; then
        refuse "gunicorn (pid $old) serves on $serves_on; a release keeps its address: stop it (kill $old) to move to $bind"
    fi
fi

echo "== 2. the release $release: its own venv, this checkout's wheel"
# A release that does not end up current is removed, however the script ends.
trap '[ "$(readlink "$home/current")" = "$release" ] || rm -rf "$release"' EXIT
build

echo "== 3. the PostgreSQL role and database $db"
# Kept from the environment file on a re-run, so the running service's connections stay valid.
password=""
if [ -f "$env_file" ]; then
    password=$(sed -n "s|^DATABASE_URL=postgresql://$db:\([0-9a-f]*\)@.*|\1|p" "$env_file")
fi
password=${password:-$(openssl rand -hex 24)}
admin -v name="$db" -v password="$password" <<'SQL'
select format('create role %I login', :'name')
 where not exists (select from pg_roles where rolname = :'name') \gexec
alter role :"name" login password :'password';
select format('create database %I owner %I', :'name', :'name')
 where not exists (select from pg_database where datname = :'name') \gexec
SQL

echo "== 4. the environment of the service, in $env_file"
(
    umask 077
    cat >"$env_file.new" <<ENV
DATABASE_URL=postgresql://$db:$password@$db_host:$db_port/$db
RATELIMIT_STORAGE_URI=${RATELIMIT_STORAGE_URI:-memory://}
PETSTORE_PROXY_COUNT=${PETSTORE_PROXY_COUNT:-1}
BIND=$bind
ENV
    # Readable by the service's group: a new master reads it at a release (PETSTORE_ENV_FILE).
    chown "root:$user" "$env_file.new"
    chmod 640 "$env_file.new"
    mv "$env_file.new" "$env_file"
)
set -a
. "$env_file"
set +a

echo "== 5. the migrations, with the new release's code; a first key in \$KEY, kept in $key_file"
"$release/venv/bin/petstore" db upgrade
# A re-run keeps the key of an earlier run while the database lists it live (by its prefix),
# rather than adding another `first` key beside it.
KEY=""
key_id=""
if [ -s "$key_file" ]; then
    KEY=$(cat "$key_file")
    key_id=$("$release/venv/bin/petstore" keys list | awk -v prefix="${KEY:0:11}" '$2 == prefix && $6 == "live" { print $1 }')
fi
if [ -n "$key_id" ]; then
    echo "the first key of an earlier run, kept: key $key_id; to replace it, run" \
        "\`$home/current/venv/bin/petstore keys rotate $key_id\` and write the key it prints to $key_file"
else
    KEY=$("$release/venv/bin/petstore" keys create --plan free --label first | tail -n 1)
    (umask 077 && echo "$KEY" >"$key_file")
fi
echo "KEY=$KEY"

# start: gunicorn on current, as $user, with exactly the environment file's settings.
start() {
    version=$(version_of "$release")
    mark_log
    point "$home/current" "$release"
    if [ "$manager" = systemd ]; then
        if [ "$home:$env_file:$state:$user" != /opt/petstore:/etc/petstore.env:/var/lib/petstore:petstore ]; then
            refuse "deploy/petstore.service names /opt/petstore, /etc/petstore.env, /var/lib/petstore and petstore: unset PETSTORE_HOME, PETSTORE_ENV, PETSTORE_STATE_DIR and PETSTORE_USER"
        fi
        cp deploy/petstore.service /etc/systemd/system/petstore.service
        systemctl daemon-reload
        systemctl enable --now petstore.service
    else
        launch
    fi
    if ! within 60 serving "$pid_file"; then
        [ -z "$previous" ] || point "$home/current" "$previous"
        echo "gunicorn does not serve $release after 60 s; what it logged:" >&2
        logged | tail -n 20 >&2
        exit 1
    fi
}

if [ "$manager" = systemd ]; then
    echo "== 6. gunicorn under systemd: petstore.service, enabled at boot, restarted when it fails"
else
    echo "== 6. gunicorn as $user in the background (no systemd as PID 1: nothing restarts it); log: $log, rotated by $logrotate"
fi
if [ -z "$old" ]; then
    start
elif ! grep -qsF "$home/current/" "/proc/$old/cmdline"; then
    # Started by an install.sh before releases: its re-exec would run that checkout again.
    echo "gunicorn (pid $old) does not run from $home/current: stopped, then started from the" \
        "release (requests are refused meanwhile, this once)"
    kill -TERM "$old"
    within 60 eval '! running "$old"' || refuse "gunicorn (pid $old) did not stop within 60 s"
    start
else
    echo "releasing beside gunicorn (pid $old), which serves $previous"
    release
fi

echo "== 7. one request; the releases before $(basename "${previous:-none}") removed"
curl -sS -i -H "Authorization: Bearer $KEY" "http://$bind/v1/pets"
echo
for stale in "$home"/releases/*; do
    if [ "$stale" != "$release" ] && [ "$stale" != "$previous" ]; then rm -rf "$stale"; fi
done
echo "gunicorn runs as pid $(cat "$pid_file") (user $user) on $release; stop it with: kill \$(cat $pid_file)"
