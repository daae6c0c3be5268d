#!/usr/bin/env bash
# One host, no systemd: the PostgreSQL role and database, the service in .venv, the migrations,
# a first key in $KEY, gunicorn with deploy/gunicorn.conf.py in the background, one request.
# Run from the checkout, as root on Debian with PostgreSQL on this machine:
#     apt-get install -y python3-venv postgresql curl openssl && bash deploy/install.sh
# Safe to run again (the role's password is renewed). Settings, all optional:
#   PETSTORE_DB         name of the role and of the database (petstore)
#   PETSTORE_DB_HOST    PETSTORE_DB_PORT: where PostgreSQL listens (127.0.0.1, 5432)
#   PG_ADMIN_URL        a superuser's libpq URL (default: the postgres account, local socket)
#   BIND                gunicorn's address (127.0.0.1:8000)
#   PETSTORE_ENV        the service's environment file, written here (/etc/petstore.env)
#   PETSTORE_STATE_DIR  gunicorn's pid file and log (/var/lib/petstore)
#   PETSTORE_VENV       the virtualenv, created when it has no petstore command (.venv)
set -euo pipefail
cd "$(dirname "$0")/.."

db=${PETSTORE_DB:-petstore}
db_host=${PETSTORE_DB_HOST:-127.0.0.1}
db_port=${PETSTORE_DB_PORT:-5432}
bind=${BIND:-127.0.0.1:8000}
env_file=${PETSTORE_ENV:-/etc/petstore.env}
state=${PETSTORE_STATE_DIR:-/var/lib/petstore}
venv=${PETSTORE_VENV:-.venv}

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

echo "== 2. the PostgreSQL role and database $db"
password=$(openssl rand -hex 24)
admin -v name="$db" -v password="$password" <<'SQL'
select format('create role %I login', :'name')
 where not exists (select from pg_roles where rolname = :'name') \gexec
alter role :"name" login password :'password';
select format('create database %I owner %I', :'name', :'name')
 where not exists (select from pg_database where datname = :'name') \gexec
SQL

echo "== 3. the environment of the service, in $env_file"
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

echo "== 4. the migrations, and a first key in \$KEY"
"$venv/bin/petstore" db upgrade
KEY=$("$venv/bin/petstore" keys create --plan free --label first | tail -n 1)
echo "KEY=$KEY"

echo "== 5. gunicorn with deploy/gunicorn.conf.py, in the background; log: $state/gunicorn.log"
mkdir -p "$state"
setsid "$venv/bin/gunicorn" -c deploy/gunicorn.conf.py --pid "$state/gunicorn.pid" wsgi:app \
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

echo "== 6. one request"
curl -sS -i -H "Authorization: Bearer $KEY" "http://$bind/v1/pets"
echo
echo "gunicorn runs as pid $(cat "$state/gunicorn.pid"); stop it with: kill \$(cat $state/gunicorn.pid)"
