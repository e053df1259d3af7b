-- fencegate fence script for a pipelined run of writes under one token: compare and raise the
-- fence once, then apply every write, in one atomic call (DESIGN.md rule 1). Its own library
-- (fencegate_batch_v1) so that gateways that only know fence.lua's library, sharing this Redis,
-- never replace or remove it, nor it theirs.
--
-- KEYS[1]        the fence key of the token's resource, fencegate:fence:{<resource>}; never a TTL
-- KEYS[2..]      the keys of the wrapped commands (declared so Redis knows them; not read here)
-- ARGV[1]        the resource name (for the error message)
-- ARGV[2]        the token's revision, canonical decimal (no sign, no leading zeros)
-- ARGV[3]        '3' when the client speaks RESP3, '2' otherwise
-- ARGV[4]        n, the number of commands
-- ARGV[5..4+n]   the number of arguments of each command (its name included)
-- ARGV[5+n..]    the commands and their arguments, one after the other
--
-- Refuses the whole run with the same `FENCED ...` error as fence.lua when the stored fence is
-- above the token (nothing applied); otherwise raises the fence to the token (equal is
-- accepted, rule 2), runs each command with redis.pcall (an error answers that command only, the
-- next ones still run, as they would one call each) and returns an array of n + 1 values: a
-- string of n characters, '1' where that command's reply was a null, then each reply unchanged.
-- A null cannot be an element of a Lua array (it ends it), so it is sent as false and the
-- gateway restores it from the string.
local function fencegate_fence_batch(keys, argv)
  local token = argv[2]
  local fence = redis.call('GET', keys[1])
  if fence and (#fence > #token or (#fence == #token and fence > token)) then
    return redis.error_reply('FENCED ' .. argv[1] .. ' token ' .. token .. ' is below fence ' .. fence)
  end
  if fence ~= token then
    redis.call('SET', keys[1], token)
  end
  if argv[3] == '3' then
    redis.setresp(3)
  end
  local n = tonumber(argv[4])
  local nulls = {}
  local replies = {''}
  local at = 5 + n
  for i = 1, n do
    local last = at + tonumber(argv[4 + i]) - 1
    local reply = redis.pcall(unpack(argv, at, last))
    at = last + 1
    if reply == nil then
      nulls[i] = '1'
      reply = false
    else
      nulls[i] = '0'
    end
    replies[i + 1] = reply
  end
  replies[1] = table.concat(nulls)
  return replies
end
