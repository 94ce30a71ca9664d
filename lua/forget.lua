-- Delete a record at an operator's word (Admin::forget), so that the client's next retry runs.
-- KEYS[1]  record key
-- KEYS[2]  settle channel of the record (same hash tag, so the same cluster slot)
-- ARGV[1]  record format version
-- ARGV[2]  '1' to delete an in-progress record whose lease still runs; '0' to refuse it
-- ARGV[3]  the publish command: PUBLISH (standalone) or SPUBLISH (Cluster)
-- Publishes on the channel when the record was waited for ('W'), so the waiters claim again.
-- Returns 0 when there was no record (an abandoned claim's marker is left as it is: it
-- refuses a late claim), 1 when deleted, 2 when refused (in progress, its lease running),
-- or {4, reason} for a value this layer did not write (left as it is).
local key = KEYS[1]
local record = redis.pcall('GET', key)
if not record then
  return 0
end
if type(record) ~= 'string' or string.sub(record, 1, 1) ~= ARGV[1] or #record < 34 then
  return {4, 'not written by this layer'}
end
local state = string.sub(record, 2, 2)
if state == 'X' then
  return 0
end
if state == 'P' or state == 'W' then
  local running = true
  if #record > 50 then
    local deadline = tonumber(string.sub(record, 51))
    local time = redis.call('TIME')
    running = deadline == nil
      or deadline > tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  end
  if running and ARGV[2] ~= '1' then
    return 2
  end
elseif state ~= 'C' then
  return {4, 'unknown state'}
end
redis.call('DEL', key)
if state == 'W' then
  redis.call(ARGV[3], KEYS[2], 'forgotten')
end
return 1
