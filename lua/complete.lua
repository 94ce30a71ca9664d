-- Store the response of a claimed request, fenced by its owner token.
-- KEYS[1]  record key
-- ARGV[1]  owner token
-- ARGV[2]  request fingerprint
-- ARGV[3]  encoded response
-- ARGV[4]  retention in milliseconds
-- ARGV[5]  record format version
-- Writes when the caller still owns the key, or when the key is absent (the lease lapsed and
-- nobody took over). Returns 1 when written, 0 when another owner, a stored response, or a
-- value this layer did not write holds it.
local key = KEYS[1]
local record = redis.pcall('GET', key)
if record then
  if type(record) == 'table' or #record ~= 50 or string.sub(record, 1, 2) ~= ARGV[5] .. 'P'
      or string.sub(record, 35) ~= ARGV[1] then
    return 0
  end
end
redis.call('SET', key, ARGV[5] .. 'C' .. ARGV[2] .. ARGV[3], 'PX', ARGV[4])
return 1
