-- Requests per key, UTC hour and outcome (petstore.usage), and the operators' audit trail
-- (petstore.audit). New tables: creating them locks nothing that requests use.

-- key_id 0 is the one aggregate of the requests without a valid key (never a client address);
-- no foreign key, so that it can exist and a key's counts outlive nothing they should not.
create table key_usage (
    key_id        bigint      not null check (key_id >= 0),
    hour          timestamptz not null check (date_trunc('hour', hour, 'UTC') = hour),
    requests_2xx  bigint      not null default 0 check (requests_2xx >= 0),
    requests_4xx  bigint      not null default 0 check (requests_4xx >= 0),
    requests_429  bigint      not null default 0 check (requests_429 >= 0),
    requests_5xx  bigint      not null default 0 check (requests_5xx >= 0),
    primary key (key_id, hour)
);

-- `petstore db prune` deletes by hour, whatever the key.
create index key_usage_hour on key_usage (hour);

-- Appended by every operator action of the `petstore` command; never changed nor deleted.
create table audit_log (
    id       bigint generated always as identity primary key,
    at       timestamptz not null default now(),
    command  text        not null,
    key_id   bigint,
    os_user  text        not null,
    reason   text
);

create index audit_log_key_at on audit_log (key_id, at);

-- A trigger refuses what a grant cannot: the table's owner (and a superuser) bypass grants, not
-- triggers. The app's role gets select and insert only (docs/usage.rst, "The audit trail").
create function audit_log_append_only() returns trigger
    language plpgsql
as $$
begin
    raise exception 'audit_log is append-only: % refused', tg_op
        using errcode = 'insufficient_privilege';
end
$$;

create trigger audit_log_append_only
    before update or delete on audit_log
    for each row execute function audit_log_append_only();
