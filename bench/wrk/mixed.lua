-- 80% reads, 20% writes: 40% a list page at a random cursor, 40% one pet, 20% POST a pet.
dofile("common.lua")

local post_headers = {
   ["Authorization"] = wrk.headers["Authorization"],
   ["Content-Type"] = "application/json",
}
local body = '{"name": "Bench", "categoryId": 7, "status": "pending"}'

function request()
   local draw = math.random(100)
   if draw <= 40 then
      return wrk.format("GET", "/v1/pets?limit=20&after=" .. (random_id() - 1))
   elseif draw <= 80 then
      return wrk.format("GET", "/v1/pets/" .. random_id())
   end
   return wrk.format("POST", "/v1/pets", post_headers, body)
end
