-- Shared by every scenario: the bearer key, random pet ids, and one machine-readable summary line.
-- The runner sets BENCH_KEY, BENCH_MIN_ID and BENCH_MAX_ID in wrk's environment.

wrk.headers["Authorization"] = "Bearer " .. os.getenv("BENCH_KEY")
min_id = tonumber(os.getenv("BENCH_MIN_ID") or "1")
max_id = tonumber(os.getenv("BENCH_MAX_ID") or "1")

local threads = 0

function setup(thread)
   threads = threads + 1
   thread:set("thread_number", threads)
end

function init(args)
   -- Each thread its own random sequence.
   math.randomseed(os.time() * 1000 + (thread_number or 0))
end

function random_id()
   return math.random(min_id, max_id)
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'BENCH {"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "mean_us": %.1f, '
         .. '"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}\n',
      summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
      latency.mean, e.connect, e.read, e.write, e.status, e.timeout))
end
