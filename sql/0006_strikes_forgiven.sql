-- When `petstore bans lift` last forgave the key's strikes: strikes counted before it no longer
-- count, whatever the limiter storage (petstore.ratelimit.bans.strike_key). Nullable and without
-- a default, so adding it rewrites nothing and holds its lock for a moment only.

alter table api_keys
    add column strikes_forgiven_at timestamptz;
