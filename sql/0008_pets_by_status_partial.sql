-- petstore: no transaction
-- squawk-disable-assume-in-transaction
-- A filtered page (GET /v1/pets?status=...) walks an index of that status's ids, in id order.
--
-- pets_status_id_idx (status, id) served it, but the planner costs its heap visits by the
-- correlation of its first column, status, which is close to none: it takes every row fetched
-- as a random page read. Told a table holds fewer rows than it does (a plain VACUUM after a run
-- of creates and their deletion estimated 10,000 pets as 2,710), it then found a sequential scan
-- and a sort of the whole table cheaper, and took it: 2.5 ms where the index takes 0.1. An index
-- of ids per status is costed by the correlation of id, which follows the table's order, so the
-- planner sees the page for what it is, a short ordered read: it keeps it with the estimate 60
-- times too low, where the two-column index lost at 11 times (docs/performance.rst).
--
-- Each insert now updates one of these small indexes (none for a pet with no status), not the
-- two-column one. The code of the previous release writes the same statements (the status in
-- the text since 1.1.0), so it uses these indexes too: the old one is dropped here, not in a
-- later release.

create index concurrently if not exists pets_available_id_idx on pets (id) where status = 'available';

create index concurrently if not exists pets_pending_id_idx on pets (id) where status = 'pending';

create index concurrently if not exists pets_sold_id_idx on pets (id) where status = 'sold';

drop index concurrently if exists pets_status_id_idx;
