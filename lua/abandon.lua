-- Settle a claim whose answer its caller never saw (the call timed out, or the caller went
-- away while it was on the wire): the claim may have landed, may still land, or never will.
-- KEYS[1]  record key
-- KEYS[2]  settle channel of the record (same hash tag, so the same cluster slot)
-- ARGV[1]  owner token of the claim
-- ARGV[2]  request fingerprint of the claim
-- ARGV[3]  record format version
-- ARGV[4]  recovery window in milliseconds: above 0, a claim that landed ends its lease now and
--          is kept for the window, so that the next claim takes it over (and asks the system
--          of record: the claim may have been a takeover of an operation that happened); 0
--          deletes it
-- ARGV[5]  how long the marker that refuses a claim still on the wire lives, in milliseconds
-- ARGV[6]  the publish command: PUBLISH (standalone) or SPUBLISH (Cluster)
-- An absent key is marked: version | 'X' | fingerprint | owner token. claim.lua refuses that
-- token's claim, should it land later, and treats the marker as absent for every other claim.
-- Returns 1 when the caller's claim held the key (its lease is ended), 2 when the key was
-- absent (marked), 0 when another owner, a stored response or a foreign value holds it.
local key = KEYS[1]
local record = redis.pcall('GET', key)
if not record then
  redis.call('SET', key, ARGV[3] .. 'X' .. ARGV[2] .. ARGV[1], 'PX', ARGV[5])
  return 2
end
if type(record) ~= 'string' or #record < 50 or string.sub(record, 1, 1) ~= ARGV[3]
    or string.sub(record, 35, 50) ~= ARGV[1] then
  return 0
end
local state = string.sub(record, 2, 2)
if state ~= 'P' and state ~= 'W' then
  return 0
end
local window = tonumber(ARGV[4])
if window > 0 then
  local time = redis.call('TIME')
  local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  redis.call('SET', key, string.sub(record, 1, 50) .. string.format('%.0f', now), 'PX', window)
else
  redis.call('DEL', key)
end
if state == 'W' then
  redis.call(ARGV[6], KEYS[2], 'released')
end
return 1
