-- What an operator sees of one record (Admin::inspect). Reads only. One key.
-- KEYS[1]  record key
-- ARGV[1]  record format version
-- ARGV[2]  '1' to return the stored response too; '0' for its size alone
-- Returns one of:
--   {0}                                           no record (absent, or an abandoned
--                                                 claim's marker)
--   {1, fingerprint, pttl, size, response}        completed ('' unless asked for)
--   {2, fingerprint, pttl, lease_left_ms, waited} in progress: lease_left_ms is negative
--                                                 once the lease lapsed; waited 1 for 'W'
--   {4, reason}                                   not written by this layer
local record = redis.pcall('GET', KEYS[1])
if not record then
  return {0}
end
if type(record) == 'table' then
  return {4, 'not a string'}
end
if string.sub(record, 1, 1) ~= ARGV[1] or #record < 34 then
  return {4, 'unknown version or truncated'}
end
local state = string.sub(record, 2, 2)
local fingerprint = string.sub(record, 3, 34)
local pttl = redis.call('PTTL', KEYS[1])
if state == 'C' then
  local response = ''
  if ARGV[2] == '1' then
    response = string.sub(record, 35)
  end
  return {1, fingerprint, pttl, #record - 34, response}
end
if state == 'X' and #record == 50 then
  return {0}
end
if (state == 'P' or state == 'W') and #record >= 50 then
  -- A record of exactly 50 bytes (written before deadlines) lives as long as its lease.
  local left = pttl
  if #record > 50 then
    local deadline = tonumber(string.sub(record, 51))
    if deadline == nil then
      return {4, 'unknown state'}
    end
    local time = redis.call('TIME')
    left = deadline - (tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000))
  end
  local waited = 0
  if state == 'W' then
    waited = 1
  end
  return {2, fingerprint, pttl, left, waited}
end
return {4, 'unknown state'}
