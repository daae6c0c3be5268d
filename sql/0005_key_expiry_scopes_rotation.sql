-- What an operator controls on a key: when it expires, what it may do, and the secret it is
-- being rotated away from.
--
-- squawk's findings here (make lint) are its recorded baseline, ignored in this file only: the
-- unique column's index is built under the ALTER's ACCESS EXCLUSIVE lock, and the four checks
-- scan the table under it (no NOT VALID). Harmless on api_keys, one row per key, and applied
-- everywhere before squawk ran. Every later migration is clean.
-- squawk-ignore-file disallowed-unique-constraint, constraint-missing-not-valid

alter table api_keys
    -- Null: the key never expires. Never in the past when the key is made.
    add column expires_at timestamptz,
    -- What the key may do: GET operations need read, POST ones write.
    add column scopes text[] not null default '{read,write}',
    -- The secret before the last rotation, accepted until previous_valid_until (the grace).
    add column previous_key_hash bytea unique,
    add column previous_valid_until timestamptz,
    add constraint api_keys_expires_after_creation check (expires_at > created_at),
    add constraint api_keys_scopes_known check (
        cardinality(scopes) > 0 and scopes <@ array['read', 'write']
        and array_position(scopes, null) is null
    ),
    add constraint api_keys_previous_hash_shape check (octet_length(previous_key_hash) = 32),
    add constraint api_keys_previous_with_grace check (
        (previous_key_hash is null) = (previous_valid_until is null)
    );
