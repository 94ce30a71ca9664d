-- Announce an instance's entries in its fleet's registry (Store::announce), and list them.
-- KEYS[1]  the registry: a sorted set of entries, each scored with the time it lasts until
--          (milliseconds, by this server's clock)
-- ARGV     pairs: an entry, and how long it lasts from now in milliseconds
-- An entry is never shortened (another instance announced it for longer); entries past
-- their time are removed, and the set expires with its last entry.
-- Returns every entry left.
local registry = KEYS[1]
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', registry, '-inf', now)
for i = 1, #ARGV, 2 do
  local untl = now + tonumber(ARGV[i + 1])
  local kept = redis.call('ZSCORE', registry, ARGV[i])
  if not kept or tonumber(kept) < untl then
    redis.call('ZADD', registry, untl, ARGV[i])
  end
end
local last = redis.call('ZRANGE', registry, -1, -1, 'WITHSCORES')
if last[2] then
  redis.call('PEXPIREAT', registry, math.ceil(tonumber(last[2])))
end
return redis.call('ZRANGE', registry, 0, -1)
