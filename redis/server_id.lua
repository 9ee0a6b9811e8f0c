-- The run id of the server that holds KEYS[1]'s slot (INFO server's run_id: new with every
-- start of a redis-server process). Called with a key of a stream shard, so a cluster
-- routes it to that shard's master. A run id that changed under a shard means another
-- server now holds its streams: a replica promoted by a failover, or a restart (with or
-- without its data, or from an older snapshot). What that server never got is gone, and the
-- caller (serve) puts it back from Postgres. Reads nothing else and writes nothing.
--
-- KEYS[1]  any key of the shard (only routes the call; not read)
-- Returns the run id, or false when INFO has none.
local info = redis.call('INFO', 'server')
return string.match(info, 'run_id:(%w+)')
