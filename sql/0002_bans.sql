-- Temporary bans of API keys that keep calling after 429.

create table bans (
    id           bigint generated always as identity primary key,
    key_id       bigint not null references api_keys (id) on delete cascade,
    banned_at    timestamptz not null default now(),
    banned_until timestamptz not null,
    -- The ban's length, kept so that a repeat ban can double it.
    seconds      integer not null check (seconds > 0),
    -- Strikes (429s in one limit window) that led to the ban.
    strikes      integer not null,
    lifted_at    timestamptz,
    check (banned_until > banned_at)
);

-- The key lookup of every request asks for the key's latest ban.
create index bans_key_id_banned_until_idx on bans (key_id, banned_until desc);
