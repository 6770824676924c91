"""Every Lua script the coordination layer runs, in one place, and their registration.

A script makes a read-check-write one atomic step, so two workers racing for a claim, a
lease or a cohort seat never both win, and repairs garbage at its key (another Redis
type, no TTL) in that same step. Scripts take every key in ``KEYS``, but the join
script's chain key, which shares the cohort key's hash tag.
"""

from __future__ import annotations

from typing import Any

# Delete a claim only if it still holds our token: a claim that expired and was taken
# by another receiver must survive our late release.
_RELEASE_LUA = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, value = pcall(cjson.decode, raw)
if ok and type(value) == 'table' and value['token'] == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# SET NX that first drops a key kept without a TTL or holding another Redis type: written
# by hand or by an attacker, such a key would hold its claim, lease or ground truth forever.
_SET_NX_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'none' and (t ~= 'string' or redis.call('PTTL', KEYS[1]) == -1) then
  redis.call('DEL', KEYS[1])
end
if redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'NX') then return 1 end
return 0
"""

# Take over a key whose value the caller read and found untrusted (ARGV[1]; '' for a
# wrong type): only if it still holds exactly that, so a genuine writer that got there
# meanwhile keeps it. With a bound (ARGV[4]), the caller found the value over it without
# reading it: taken over while it still is (any value that long is untrusted).
_TAKE_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
local drop = t ~= 'string' and t ~= 'none'
if t == 'string' then
  if ARGV[4] ~= '' then
    drop = redis.call('STRLEN', KEYS[1]) > tonumber(ARGV[4])
  else
    drop = redis.call('GET', KEYS[1]) == ARGV[1]
  end
end
if drop then redis.call('DEL', KEYS[1]) end
if redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3], 'NX') then return 1 end
return 0
"""

# Values and PTTLs of string keys in one step; a value longer than ARGV[1] bytes is
# refused by its length, never crossing the wire (64 MiB of garbage per poll would slow
# every reader for seconds).
# A triple per key: {0, -2, 0} absent; {-1, -2, 0} another type; {2, pttl, length} over
# the bound; {1, pttl, value}.
_BOUNDED_GET_LUA = """
local bound = tonumber(ARGV[1])
local out = {}
local function put(state, ttl, value)
  out[#out + 1] = state; out[#out + 1] = ttl; out[#out + 1] = value
end
for _, key in ipairs(KEYS) do
  local t = redis.call('TYPE', key)['ok']
  if t == 'none' then put(0, -2, 0)
  elseif t ~= 'string' then put(-1, -2, 0)
  else
    local ttl, n = redis.call('PTTL', key), redis.call('STRLEN', key)
    if n > bound then put(2, ttl, n) else put(1, ttl, redis.call('GET', key)) end
  end
end
return out
"""

# The items at positions ARGV[1]..ARGV[2] of a list (LRANGE's indexes), each as its value
# or, when longer than ARGV[3] bytes, as its length (an integer): an oversized item never
# crosses the wire. One LINDEX per position, so the server holds one item at a time
# beside the list, never the range (LRANGE here would copy every item at once).
# {0}: absent; {-1}: another type; {1, item...}.
_BOUNDED_RANGE_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return {0} end
if t ~= 'list' then return {-1} end
local n = redis.call('LLEN', KEYS[1])
local first, last = tonumber(ARGV[1]), tonumber(ARGV[2])
if first < 0 then first = math.max(n + first, 0) end
if last < 0 then last = n + last end
if last >= n then last = n - 1 end
local bound = tonumber(ARGV[3])
local out = {1}
for i = first, last do
  local v = redis.call('LINDEX', KEYS[1], i)
  if not v then break end
  if string.len(v) > bound then out[#out + 1] = string.len(v) else out[#out + 1] = v end
end
return out
"""

# The last item of a list, popped, as its value or, when longer than ARGV[1] bytes, as
# its length (dropped: an oversized item never crosses the wire).
# {0}: absent or empty; {-1}: another type; {2, length}; {1, value}.
_BOUNDED_POP_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return {0} end
if t ~= 'list' then return {-1} end
local v = redis.call('RPOP', KEYS[1])
if not v then return {0} end
local n = string.len(v)
if n > tonumber(ARGV[1]) then return {2, n} end
return {1, v}
"""

# The members of a set of at most ARGV[1] members, without those longer than ARGV[2]
# bytes (their count returned instead): a few members at a time (SSCAN), so the server
# never copies the whole set, and an oversized member never crosses the wire.
# {0}: absent; {-1}: another type; {2, size}: more members than ARGV[1];
# {1, size, skipped, member...} (a member may repeat: SSCAN's own guarantee).
_BOUNDED_MEMBERS_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return {0} end
if t ~= 'set' then return {-1} end
local n = redis.call('SCARD', KEYS[1])
if n > tonumber(ARGV[1]) then return {2, n} end
local bound = tonumber(ARGV[2])
local out = {1, n, 0}
local cursor = '0'
repeat
  local got = redis.call('SSCAN', KEYS[1], cursor, 'COUNT', 8)
  cursor = got[1]
  for _, m in ipairs(got[2]) do
    if string.len(m) > bound then out[3] = out[3] + 1 else out[#out + 1] = m end
  end
until cursor == '0'
return out
"""

# One SCAN step (KEYS[1]: a key of the namespace, so a cluster runs it on the node that
# holds the namespace): the names matching ARGV[2], without those longer than ARGV[4]
# bytes (no key of ours is: anyone may make one of 512 MB). {cursor, name...}.
_BOUNDED_SCAN_LUA = """
local got = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', ARGV[3])
local out = {got[1]}
for _, k in ipairs(got[2]) do
  if string.len(k) <= tonumber(ARGV[4]) then out[#out + 1] = k end
end
return out
"""

# A peer entry and its index in one step; an index of another type or oversized
# (garbage) is replaced, or it would refuse every publication and hide every holder.
_PUBLISH_LUA = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local t = redis.call('TYPE', KEYS[2])['ok']
if (t ~= 'set' and t ~= 'none') or (t == 'set' and redis.call('SCARD', KEYS[2]) > tonumber(ARGV[4])) then
  redis.call('DEL', KEYS[2])
end
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""

# Drop a key of another Redis type than ARGV[1]; extend it by ARGV[2] ms if given.
_REPAIR_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return 0 end
if t ~= ARGV[1] then redis.call('DEL', KEYS[1]) return -1 end
if ARGV[2] ~= '' then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""

# A request pushed onto a queue that may hold garbage of another type (replaced).
_PUSH_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'list' and t ~= 'none' then redis.call('DEL', KEYS[1]) end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[2]), -1)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# A holder's heartbeat on the ground truth it holds: 1 and extended if the value is
# still the one it last verified (ARGV[1], its SHA-1), 0 absent, -1 another Redis type,
# 2 changed (the caller reads and verifies it); over ARGV[3] bytes it is not hashed.
_KEEP_TRUTH_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return 0 end
if t ~= 'string' then return -1 end
if redis.call('STRLEN', KEYS[1]) > tonumber(ARGV[3]) then return 2 end
if ARGV[1] ~= '' and redis.sha1hex(redis.call('GET', KEYS[1])) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 2
"""

# Compare-and-set on the raw JSON value (handshake values, lease renewals): the side
# that loses the race learns it from the return value, never from a later read.
_CAS_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) and 1 or 0
end
return 0
"""

# Compare-and-delete on the raw value (a lease's release, a stream record's drop).
_CAD_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# Take a seat in the current cohort: the n-th arrival of a window sits at position
# (n-1) % max in chain (n-1) // max, its record pushed in the same step. Every arrival
# renews the window (a rolling start joins in flight); a new window gets a new epoch.
# A hash or chain that is not one we write starts a new window instead of refusing joins.
_JOIN_COHORT_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'hash' then
  local n0 = redis.call('HGET', KEYS[1], 'n')
  local e0 = redis.call('HGET', KEYS[1], 'epoch')
  local ttl = redis.call('PTTL', KEYS[1])
  if not n0 or not e0 or not string.match(n0, '^%d%d?%d?%d?%d?%d?%d?%d?%d?$')
     or not string.match(e0, '^[0-9a-f][0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?$')
     or ttl < 0 or ttl > 2 * tonumber(ARGV[2]) then
    redis.call('DEL', KEYS[1])
  end
elseif t ~= 'none' then
  redis.call('DEL', KEYS[1])
end
local n = redis.call('HINCRBY', KEYS[1], 'n', 1)
if n == 1 then
  redis.call('HSET', KEYS[1], 'epoch', ARGV[1])
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local epoch = redis.call('HGET', KEYS[1], 'epoch') or ARGV[1]
local size = tonumber(ARGV[3])
local chain = KEYS[1] .. ':' .. epoch .. ':' .. math.floor((n - 1) / size)
local ct = redis.call('TYPE', chain)['ok']
if ct ~= 'list' and ct ~= 'none' then redis.call('DEL', chain) end
redis.call('RPUSH', chain, ARGV[4])
redis.call('PEXPIRE', chain, ARGV[5])
return {chain, (n - 1) % size}
"""


class Scripts:
    """The scripts registered with one client (redis-py runs each by its SHA, loading it
    on the first ``NOSCRIPT``)."""

    def __init__(self, client: Any) -> None:
        self.release = client.register_script(_RELEASE_LUA)
        self.cas = client.register_script(_CAS_LUA)
        self.cad = client.register_script(_CAD_LUA)
        self.join_cohort = client.register_script(_JOIN_COHORT_LUA)
        self.set_nx = client.register_script(_SET_NX_LUA)
        self.take = client.register_script(_TAKE_LUA)
        self.bounded_get = client.register_script(_BOUNDED_GET_LUA)
        self.bounded_range = client.register_script(_BOUNDED_RANGE_LUA)
        self.bounded_pop = client.register_script(_BOUNDED_POP_LUA)
        self.bounded_members = client.register_script(_BOUNDED_MEMBERS_LUA)
        self.bounded_scan = client.register_script(_BOUNDED_SCAN_LUA)
        self.publish = client.register_script(_PUBLISH_LUA)
        self.repair = client.register_script(_REPAIR_LUA)
        self.push = client.register_script(_PUSH_LUA)
        self.keep_truth = client.register_script(_KEEP_TRUTH_LUA)
