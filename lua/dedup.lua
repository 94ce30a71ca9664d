-- Add an event to its bucket set unless a neighbouring bucket holds it (the dedup door).
-- KEYS[1..3]  the sets of the bucket before, the event's own bucket, the bucket after; one
--             hash tag, so one Cluster slot
-- ARGV[1]     the event's member (16 bytes of its hash)
-- ARGV[2]     when the event's own set expires, in milliseconds since the Unix epoch
-- Returns 1 when the event was in none of the sets (it is new, and now added), 0 otherwise.
for i = 1, 3 do
  if redis.call('SISMEMBER', KEYS[i], ARGV[1]) == 1 then
    return 0
  end
end
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('PEXPIREAT', KEYS[2], ARGV[2])
return 1
