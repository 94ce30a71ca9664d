-- Add a page's events (one shard's) to their bucket set unless a neighbouring bucket holds them
-- (the dedup door's bucketed sets).
-- KEYS[1..3]  the sets of the bucket before, the events' own bucket, the bucket after; one
--             hash tag, so one Cluster slot
-- ARGV[1]     when the events' own set expires, in milliseconds since the Unix epoch
-- ARGV[2..]   the events' members (16 bytes of each one's hash)
-- Returns, for each member in order, 1 when it was in none of the sets (it is new, and now
-- added), 0 otherwise.
local fresh, added = {}, false
for j = 2, #ARGV do
  local new = 1
  for i = 1, 3 do
    if redis.call('SISMEMBER', KEYS[i], ARGV[j]) == 1 then
      new = 0
      break
    end
  end
  if new == 1 then
    redis.call('SADD', KEYS[2], ARGV[j])
    added = true
  end
  fresh[j - 1] = new
end
if added then
  redis.call('PEXPIREAT', KEYS[2], ARGV[1])
end
return fresh
