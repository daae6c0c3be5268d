-- Start at the URL's path (the 1,000th page) and follow Link rel="next" from each response;
-- back to the start after the last page. Connections of one thread share the cursor.
dofile("common.lua")

local start = nil
local next_path = nil

function request()
   start = start or wrk.path
   return wrk.format("GET", next_path or start)
end

function response(status, headers, body)
   local link = headers["Link"] or headers["link"]
   next_path = link and link:match('<([^>]*)>; rel="next"') or start
end
