-- POST /v1/pets with a small JSON body.
dofile("common.lua")

wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"name": "Bench", "categoryId": 7, "status": "available"}'
