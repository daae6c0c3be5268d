-- Pets and API keys.
--
-- The database backs every rule it can, so that a bug in Python cannot store
-- an invalid row: identity ids, not null, an enum for the status.

create type pet_status as enum ('available', 'pending', 'sold');

create table pets (
    id          bigint generated always as identity primary key,
    name        text not null check (name <> ''),
    category_id bigint not null,
    -- Null means "not stated": the spec forbids assuming a default.
    status      pet_status,
    created_at  timestamptz not null default now()
);

-- Keyset pagination of a status-filtered listing: GET /v1/pets?status=...&after=...
create index pets_status_id_idx on pets (status, id);

create type api_plan as enum ('free', 'pro', 'business', 'enterprise');

create table api_keys (
    id          bigint generated always as identity primary key,
    -- sha256 of the secret; the secret itself is never stored.
    key_hash    bytea not null unique check (octet_length(key_hash) = 32),
    -- The first characters of the secret, to recognise a key in listings.
    prefix      text not null,
    label       text not null default '',
    plan        api_plan not null,
    -- Per-key numbers: required for enterprise, optional overrides otherwise.
    per_minute  integer check (per_minute > 0),
    per_day     integer check (per_day > 0),
    created_at  timestamptz not null default now(),
    revoked_at  timestamptz,
    check (plan <> 'enterprise' or (per_minute is not null and per_day is not null))
);
