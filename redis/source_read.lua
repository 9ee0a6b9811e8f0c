-- One read of new entries of a source stream for a consumer group, bounded in bytes as well
-- as in entries: XREADGROUP's COUNT bounds only the entries, so a reply of big entries could
-- hold far more than the reader's byte budget before the budget saw any of them. Entries are
-- read one at a time and the read stops once they hold ARGV[4] bytes (fields and values), so
-- a reply holds at most that plus one entry. Entries read are delivered (in the group's
-- pending list) exactly as by one XREADGROUP.
--
-- KEYS[1]  the source stream
-- ARGV[1]  the group
-- ARGV[2]  the consumer
-- ARGV[3]  most entries to read (at least 1)
-- ARGV[4]  bytes after which no further entry is read (at least 1)
--
-- Returns the entries read, as XRANGE does: {{id, {field, value, ...}}, ...}. An error of the
-- read (NOGROUP: the group or stream is gone) is returned as it is, so that the reader
-- recreates the group as after a plain XREADGROUP.
local most, budget = tonumber(ARGV[3]), tonumber(ARGV[4])
local out, bytes = {}, 0
for _ = 1, most do
  local r = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', KEYS[1], '>')
  if type(r) == 'table' and r.err then
    return redis.error_reply(r.err)
  end
  if not r then
    break
  end
  local entry = r[1][2][1]
  out[#out + 1] = entry
  for _, part in ipairs(entry[2]) do
    bytes = bytes + #part
  end
  if bytes >= budget then
    break
  end
end
return out
