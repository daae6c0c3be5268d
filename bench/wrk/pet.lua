-- GET /v1/pets/{id} for random ids among the seeded pets.
dofile("common.lua")

function request()
   return wrk.format("GET", "/v1/pets/" .. random_id())
end
