#!/usr/bin/env bash
# One host, no systemd: the PostgreSQL role and database, the service in .venv, the migrations,
# a first key in $KEY, gunicorn with deploy/gunicorn.conf.py in the background as the system user
# petstore (which may read the code, not change it, and writes only PETSTORE_STATE_DIR), one request.
# Run from the checkout, as root on Debian with PostgreSQL on this machine:
#     apt-get install -y python3-venv postgresql curl openssl && bash deploy/install.sh
# Safe to run again: the role keeps its password, the first key is kept (beside the environment
# file, root's alone) while the database knows it live, and a gunicorn it started is stopped and
# started again with the new settings. Settings, all optional:
#   PETSTORE_DB         name of the role and of the database (petstore)
#   PETSTORE_DB_HOST    PETSTORE_DB_PORT: where PostgreSQL listens (127.0.0.1, 5432)
#   PG_ADMIN_URL        a superuser's libpq URL (default: the postgres account, local socket)
#   BIND                gunicorn's address (127.0.0.1:8000)
#   PETSTORE_ENV        the service's environment file, written here (/etc/petstore.env); the
#                       first key is kept beside it, its .env replaced by .key (/etc/petstore.key)
#   PETSTORE_STATE_DIR  gunicorn's pid file and log (/var/lib/petstore)
#   PETSTORE_VENV       the virtualenv, created when it has no petstore command (.venv)
#   PETSTORE_USER       the system user the service runs as, created when missing (petstore)
set -euo pipefail
cd "$(dirname "$0")/.."

db=${PETSTORE_DB:-petstore}
db_host=${PETSTORE_DB_HOST:-127.0.0.1}
db_port=${PETSTORE_DB_PORT:-5432}
bind=${BIND:-127.0.0.1:8000}
env_file=${PETSTORE_ENV:-/etc/petstore.env}
state=${PETSTORE_STATE_DIR:-/var/lib/petstore}
venv=${PETSTORE_VENV:-.venv}
user=${PETSTORE_USER:-petstore}
pid_file=$state/gunicorn.pid
key_file=${env_file%.env}.key

as_user() {
    setpriv --reuid="$user" --regid="$user" --init-groups "$@"
}

admin() {
    if [ -n "${PG_ADMIN_URL:-}" ]; then
        psql "$PG_ADMIN_URL" -X -q -v ON_ERROR_STOP=1 "$@"
    else
        runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 "$@"
    fi
}

echo "== 1. the service, in $venv"
if [ ! -x "$venv/bin/petstore" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet .
fi

echo "== 2. the system user $user: reads the code, writes $state only"
if ! id -u "$user" >/dev/null 2>&1; then
    useradd --system --user-group --home-dir "$state" --no-create-home \
        --shell /usr/sbin/nologin "$user"
fi
mkdir -p "$state"
touch "$state/gunicorn.log"
chown "$user:$user" "$state" "$state/gunicorn.log"
chmod 750 "$state"
for path in . "$venv" "$venv/bin"; do
    if as_user test -w "$path"; then
        echo "refusing: $user may write $(realpath "$path"), the code: make root own it" >&2
        exit 1
    fi
done
if ! as_user test -r wsgi.py -a -x "$venv/bin/gunicorn" -a -w "$state"; then
    echo "refusing: $user cannot read $PWD and $venv, or write $state: open their parents" >&2
    exit 1
fi

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
    cat >"$env_file" <<ENV
DATABASE_URL=postgresql://$db:$password@$db_host:$db_port/$db
RATELIMIT_STORAGE_URI=${RATELIMIT_STORAGE_URI:-memory://}
PETSTORE_PROXY_COUNT=${PETSTORE_PROXY_COUNT:-1}
BIND=$bind
ENV
)
set -a
. "$env_file"
set +a

echo "== 5. the migrations, and a first key in \$KEY, kept in $key_file"
"$venv/bin/petstore" db upgrade
# A re-run keeps the key of an earlier run while the database lists it live (by its prefix),
# rather than adding another `first` key beside it.
KEY=""
key_id=""
if [ -s "$key_file" ]; then
    KEY=$(cat "$key_file")
    key_id=$("$venv/bin/petstore" keys list | awk -v prefix="${KEY:0:11}" '$2 == prefix && $6 == "live" { print $1 }')
fi
if [ -n "$key_id" ]; then
    echo "the first key of an earlier run, kept: key $key_id; to replace it, run" \
        "\`$venv/bin/petstore keys rotate $key_id\` and write the key it prints to $key_file"
else
    KEY=$("$venv/bin/petstore" keys create --plan free --label first | tail -n 1)
    (umask 077 && echo "$KEY" >"$key_file")
fi
echo "KEY=$KEY"

echo "== 6. gunicorn with deploy/gunicorn.conf.py as $user, in the background; log: $state/gunicorn.log"
# A gunicorn of an earlier run is stopped (SIGTERM: its running requests finish), so that the
# one started below serves these settings.
if [ -s "$pid_file" ] && grep -qs gunicorn "/proc/$(cat "$pid_file")/cmdline"; then
    old=$(cat "$pid_file")
    echo "stopping the gunicorn of an earlier run (pid $old), to start it with these settings"
    kill -TERM "$old"
    for _ in $(seq 1 60); do
        if ! kill -0 "$old" 2>/dev/null; then break; fi
        sleep 0.5
    done
    if kill -0 "$old" 2>/dev/null; then
        echo "gunicorn (pid $old) did not stop within 30 s: stop it (kill -9 $old), then run this again" >&2
        exit 1
    fi
fi
if curl -fsS "http://$bind/readyz" >/dev/null 2>&1; then
    echo "refusing: another program answers on $bind: stop it, or choose another BIND" >&2
    exit 1
fi
setsid setpriv --reuid="$user" --regid="$user" --init-groups \
    "$venv/bin/gunicorn" -c deploy/gunicorn.conf.py --pid "$pid_file" wsgi:app \
    </dev/null >>"$state/gunicorn.log" 2>&1 &
ready=no
for _ in $(seq 1 60); do
    if curl -fsS "http://$bind/readyz" >/dev/null 2>&1; then ready=yes && break; fi
    sleep 0.5
done
if [ "$ready" = no ]; then
    echo "gunicorn is not ready after 30 s; the end of its log:" >&2
    tail -n 20 "$state/gunicorn.log" >&2
    exit 1
fi

echo "== 7. one request"
curl -sS -i -H "Authorization: Bearer $KEY" "http://$bind/v1/pets"
echo
echo "gunicorn runs as pid $(cat "$pid_file") (user $user); stop it with: kill \$(cat $pid_file)"
