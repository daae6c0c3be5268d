-- Responses to POST requests sent with an Idempotency-Key, replayed to retries for 24 hours.

create table idempotency_requests (
    key_id          bigint not null references api_keys (id) on delete cascade,
    idempotency_key text not null check (length(idempotency_key) between 1 and 255),
    -- sha256 of the validated request body: the same key with another body is refused.
    fingerprint     bytea not null check (octet_length(fingerprint) = 32),
    status          integer not null,
    body            text not null,
    location        text,
    created_at      timestamptz not null default now(),
    primary key (key_id, idempotency_key)
);

-- `petstore db prune` deletes what is older than 24 hours.
create index idempotency_requests_created_at_idx on idempotency_requests (created_at);
