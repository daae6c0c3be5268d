-- The JSON of a Pet, written in one place: `status` left out when it was never stated.
-- A one-expression SQL function, so the planner inlines it: it costs nothing over the
-- expression itself (stable, like json_build_object, or it would not be inlined).

create function pet_json(id bigint, name text, category_id bigint, status pet_status)
returns json
language sql
stable
parallel safe
as $$
    select json_strip_nulls(json_build_object(
        'id', id, 'name', name, 'categoryId', category_id, 'status', status
    ))
$$;
