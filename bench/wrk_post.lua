-- wrk script for the bench: POST the JSON body in $BENCH_BODY, print the results as one JSON line.
-- $BENCH_BODIES (one body a line), when it holds more than one, is sent in turn, request by request.
-- Percentiles come from wrk's record of every request's latency (microseconds).
wrk.method = "POST"
wrk.body = os.getenv("BENCH_BODY") or "{}"
wrk.headers["Content-Type"] = "application/json"

local bodies = {}
for line in string.gmatch(os.getenv("BENCH_BODIES") or "", "[^\n]+") do bodies[#bodies + 1] = line end
if #bodies > 1 then
  local requests = {}
  for i, body in ipairs(bodies) do requests[i] = wrk.format(nil, nil, nil, body) end
  local turn = 0
  request = function()
    turn = turn % #requests + 1
    return requests[turn]
  end
end

local points = {}
for p = 1, 99 do points[#points + 1] = p end
for _, p in ipairs({99.5, 99.9, 99.99}) do points[#points + 1] = p end

done = function(summary, latency, requests)
  local pct = {}
  for _, p in ipairs(points) do
    pct[#pct + 1] = string.format('"%s":%d', tostring(p), latency:percentile(p))
  end
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"duration_us":%d,"bytes":%d,"errors":{"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d},"latency_us":{"min":%d,"mean":%f,"max":%d,"pct":{%s}}}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.max, table.concat(pct, ",")))
end
