-- Set a page's events (one shard's) in their bucket's Bloom filter unless a neighbouring
-- filter holds them (the dedup door's Bloom filters).
-- KEYS[1..3]  the filters of the bucket before, the events' own bucket, the bucket after; one
--             hash tag, so one Cluster slot
-- ARGV[1]     when the events' own filter expires, in milliseconds since the Unix epoch
-- ARGV[2]     the bits of one event, k
-- ARGV[3]     a filter's size in bytes
-- ARGV[4..]   each event's k bit positions, event after event
-- Returns, for each event in order, 1 when no filter had all its bits set (it is new, and its
-- bits are now set in its own filter), 0 otherwise.
local k = tonumber(ARGV[2])
local present = {}
for i = 1, 3 do
  present[i] = redis.call('EXISTS', KEYS[i]) == 1
end
local fresh, added, set = {}, false, {}
for e = 0, (#ARGV - 3) / k - 1 do
  local first = 3 + e * k
  local new = 1
  for i = 1, 3 do
    if present[i] then
      -- A bit clear is the answer; about two reads in a filter at its load.
      local all = 1
      for h = 1, k do
        if redis.call('GETBIT', KEYS[i], ARGV[first + h]) == 0 then
          all = 0
          break
        end
      end
      if all == 1 then
        new = 0
        break
      end
    end
  end
  if new == 1 then
    if not present[2] then
      -- Whole from the start: a string grown bit by bit is allocated up to twice its size.
      redis.call('SET', KEYS[2], string.rep('\0', tonumber(ARGV[3])))
      present[2] = true
    end
    for h = 1, k do
      set[4 * h - 3], set[4 * h - 2], set[4 * h - 1], set[4 * h] = 'SET', 'u1', ARGV[first + h], 1
    end
    redis.call('BITFIELD', KEYS[2], unpack(set))
    added = true
  end
  fresh[e + 1] = new
end
if added then
  redis.call('PEXPIREAT', KEYS[2], ARGV[1])
end
return fresh
