-- Delete a claimed record so that a retry can run, fenced by its owner token.
-- KEYS[1]  record key
-- ARGV[1]  owner token
-- ARGV[2]  record format version
-- Returns 1 when deleted, 0 when the caller no longer owns the key.
local key = KEYS[1]
local record = redis.pcall('GET', key)
if type(record) == 'string' and #record == 50 and string.sub(record, 1, 2) == ARGV[2] .. 'P'
    and string.sub(record, 35) == ARGV[1] then
  redis.call('DEL', key)
  return 1
end
return 0
