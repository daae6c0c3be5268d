-- GET the URL's path on every request (a list page: the same query each time).
dofile("common.lua")
