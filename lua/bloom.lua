-- Set a page's events (one shard's) in their bucket's Bloom filter unless a neighbouring
-- filter holds them (the dedup door's Bloom filters).
-- KEYS[1..3]  the filters of the bucket before, the events' own bucket, the bucket after; one
--             hash tag, so one Cluster slot
-- ARGV[1]     when the events' own filter expires, in milliseconds since the Unix epoch
-- ARGV[2]     the bits of one event, k
-- ARGV[3..]   each event's k bit positions, event after event
-- Returns, for each event in order, 1 when no filter had all its bits set (it is new, and its
-- bits are now set in its own filter), 0 otherwise.
local k = tonumber(ARGV[2])
local fresh, added = {}, false
local get, set = {}, {}
for e = 0, (#ARGV - 2) / k - 1 do
  for h = 1, k do
    local bit = ARGV[2 + e * k + h]
    get[3 * h - 2], get[3 * h - 1], get[3 * h] = 'GET', 'u1', bit
    set[4 * h - 3], set[4 * h - 2], set[4 * h - 1], set[4 * h] = 'SET', 'u1', bit, 1
  end
  local new = 1
  for i = 1, 3 do
    local bits = redis.call('BITFIELD', KEYS[i], unpack(get))
    local all = 1
    for h = 1, k do
      if bits[h] == 0 then
        all = 0
        break
      end
    end
    if all == 1 then
      new = 0
      break
    end
  end
  if new == 1 then
    redis.call('BITFIELD', KEYS[2], unpack(set))
    added = true
  end
  fresh[e + 1] = new
end
if added then
  redis.call('PEXPIREAT', KEYS[2], ARGV[1])
end
return fresh
