package discovery

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// registryKeySuffix names the sorted set of registrations under the prefix.
// It is the name the registry has always used, so replicas of an older
// version, during a rolling upgrade, share the set with newer ones (see
// NewRedisStore). It is the only key every script touches, so each script
// stays within one hash slot.
const registryKeySuffix = "bootstrap:encoders"

// registryKeyGrace is how long the key outlives its latest expiry. The key's
// own expiry is relative (PEXPIRE); it only keeps an abandoned key from
// staying forever.
const registryKeyGrace = 60 * time.Second

// registryScriptHead starts every script: it reads Redis's clock (TIME; a
// script may write after it, as scripts are replicated by their effects
// since Redis 5) into now (unix ms) and defines the helpers.
//
// The set's scores: a registration's is its expiry (unix ms, > 0), as it
// always was; an unregistered URL's tombstone is the negated expiry of the
// tombstone (< 0). A URL is one member, so it is either registered or
// unregistered, and one ZSCORE tells which. Older replicas read a negative
// score as an expired registration, and drop it at their next add.
//
// sweep drops expired registrations (0 < score <= now) and tombstones
// (-now <= score < 0). keep moves the key's own expiry to grace past the
// latest expiry it holds. int formats a number as an integer (a Lua number
// as an argument may be sent in exponent form).
const registryScriptHead = `
local key = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function int(x) return string.format('%d', x) end
local function sweep()
  redis.call('ZREMRANGEBYSCORE', key, int(-now), int(now))
end
local function keep(grace)
  local last = 0
  local hi = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if hi[2] and tonumber(hi[2]) > 0 then last = tonumber(hi[2]) - now end
  local lo = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if lo[2] and tonumber(lo[2]) < 0 and -tonumber(lo[2]) - now > last then last = -tonumber(lo[2]) - now end
  if last < 1 then last = 1 end
  redis.call('PEXPIRE', key, int(last + grace))
end
local function live()
  return redis.call('ZCOUNT', key, '(' .. int(now), '+inf')
end
`

// registryAddScript registers a URL for a TTL: it refuses one that is not
// live while max are, else adds it or moves its expiry (clearing a
// tombstone), in one step so that replicas cannot both pass the bound. It
// returns 1 when stored, 0 when full.
//
// KEYS[1] the set; ARGV[1] url, ARGV[2] ttl (ms), ARGV[3] max, ARGV[4] key
// grace (ms).
var registryAddScript = redis.NewScript(registryScriptHead + `
sweep()
local s = redis.call('ZSCORE', key, ARGV[1])
if not (s and tonumber(s) > 0) then
  if live() >= tonumber(ARGV[3]) then
    return 0
  end
end
redis.call('ZADD', key, int(now + tonumber(ARGV[2])), ARGV[1])
keep(tonumber(ARGV[4]))
return 1
`)

// registryRefreshScript moves the expiry of the live URLs to now+ttl and
// adds back those the set lacks, unless they have a tombstone or max are
// live. The tombstone check and the write are one step, so a refresh racing
// an unregistration on another replica cannot bring the URL back. It returns
// one outcome per URL, RefreshOutcome's values.
//
// KEYS[1] the set; ARGV[1] ttl (ms), ARGV[2] max, ARGV[3] key grace (ms),
// ARGV[4...] the URLs.
var registryRefreshScript = redis.NewScript(registryScriptHead + `
sweep()
local exp = now + tonumber(ARGV[1])
local max = tonumber(ARGV[2])
local n = live()
local out = {}
for i = 4, #ARGV do
  local s = redis.call('ZSCORE', key, ARGV[i])
  if s then s = tonumber(s) end
  if s and s < 0 then
    out[#out + 1] = 2
  elseif s then
    if s < exp then redis.call('ZADD', key, int(exp), ARGV[i]) end
    out[#out + 1] = 0
  elseif n < max then
    redis.call('ZADD', key, int(exp), ARGV[i])
    n = n + 1
    out[#out + 1] = 1
  else
    out[#out + 1] = 3
  end
end
keep(tonumber(ARGV[3]))
return out
`)

// registryRemoveScript replaces a URL's registration (if any) by a tombstone
// that expires after ttl. Past max tombstones, the one that would expire
// first makes room: tombstones sort before registrations, the most negative
// (latest expiry) first, so it is the last of them.
//
// KEYS[1] the set; ARGV[1] url, ARGV[2] ttl (ms), ARGV[3] max, ARGV[4] key
// grace (ms).
var registryRemoveScript = redis.NewScript(registryScriptHead + `
sweep()
local s = redis.call('ZSCORE', key, ARGV[1])
if not (s and tonumber(s) < 0) then
  local n = redis.call('ZCOUNT', key, '-inf', '(0')
  if n >= tonumber(ARGV[3]) then
    redis.call('ZREMRANGEBYRANK', key, n - 1, n - 1)
  end
end
redis.call('ZADD', key, int(-(now + tonumber(ARGV[2]))), ARGV[1])
keep(tonumber(ARGV[4]))
return 1
`)

// registryListScript reads, without writing, the live URLs with their time
// left (ms) and the URLs with a tombstone, by Redis's clock.
//
// KEYS[1] the set.
var registryListScript = redis.NewScript(registryScriptHead + `
local live = redis.call('ZRANGEBYSCORE', key, '(' .. int(now), '+inf', 'WITHSCORES')
local out = {}
for i = 1, #live, 2 do
  out[#out + 1] = live[i]
  out[#out + 1] = int(tonumber(live[i + 1]) - now)
end
return {out, redis.call('ZRANGEBYSCORE', key, '-inf', '(' .. int(-now))}
`)

// NewRedisStore returns a Store shared by every gateway replica using
// client and prefix, so a registration on one is seen by all. It keeps one
// sorted set, prefix+"bootstrap:encoders": member = URL, score = expiry in
// unix milliseconds for a registration, the negated expiry of its tombstone
// for an unregistered URL. Every read and write is a script that takes the
// time from Redis (TIME), so the replicas' clocks play no part in expiry.
//
// The key and the registrations' scores are those of earlier versions, so
// during a rolling upgrade old and new replicas share one set. An old
// replica sees a tombstone as an expired registration: it lists it nowhere,
// and its next registration removes it (with every other expired member),
// so until the upgrade is done an unregistration may be re-asserted by a new
// replica that still serves it after an old replica registered something.
func NewRedisStore(client redis.UniversalClient, prefix string) Store {
	return &redisStore{c: client, key: prefix + registryKeySuffix}
}

// redisStore is the Redis Store.
type redisStore struct {
	c   redis.UniversalClient
	key string
}

func (s *redisStore) Add(ctx context.Context, url string, ttl time.Duration, max int) error {
	n, err := registryAddScript.Run(ctx, s.c, []string{s.key},
		url, ttl.Milliseconds(), max, registryKeyGrace.Milliseconds()).Int()
	if err != nil {
		return fmt.Errorf("redis: %w", err)
	}
	if n == 0 {
		return ErrFull
	}
	return nil
}

func (s *redisStore) Refresh(ctx context.Context, urls []string, ttl time.Duration, max int) ([]RefreshOutcome, error) {
	if len(urls) == 0 {
		return nil, nil
	}
	args := make([]any, 0, 3+len(urls))
	args = append(args, ttl.Milliseconds(), max, registryKeyGrace.Milliseconds())
	for _, u := range urls {
		args = append(args, u)
	}
	codes, err := registryRefreshScript.Run(ctx, s.c, []string{s.key}, args...).Int64Slice()
	if err != nil {
		return nil, fmt.Errorf("redis: %w", err)
	}
	if len(codes) != len(urls) {
		return nil, fmt.Errorf("redis: refresh answered %d outcomes for %d urls", len(codes), len(urls))
	}
	out := make([]RefreshOutcome, len(codes))
	for i, c := range codes {
		if c < int64(RefreshExtended) || c > int64(RefreshFull) {
			return nil, fmt.Errorf("redis: refresh answered outcome %d", c)
		}
		out[i] = RefreshOutcome(c)
	}
	return out, nil
}

func (s *redisStore) Remove(ctx context.Context, url string, ttl time.Duration, max int) error {
	err := registryRemoveScript.Run(ctx, s.c, []string{s.key},
		url, ttl.Milliseconds(), max, registryKeyGrace.Milliseconds()).Err()
	if err != nil {
		return fmt.Errorf("redis: %w", err)
	}
	return nil
}

func (s *redisStore) List(ctx context.Context) (Listing, error) {
	v, err := registryListScript.Run(ctx, s.c, []string{s.key}).Slice()
	if err != nil {
		return Listing{}, fmt.Errorf("redis: %w", err)
	}
	bad := func(what string) (Listing, error) {
		return Listing{}, fmt.Errorf("redis: unexpected list reply: %s", what)
	}
	if len(v) != 2 {
		return bad("not two arrays")
	}
	live, ok1 := v[0].([]any)
	gone, ok2 := v[1].([]any)
	if !ok1 || !ok2 || len(live)%2 != 0 {
		return bad("not two arrays")
	}
	var l Listing
	for i := 0; i < len(live); i += 2 {
		u, ok := live[i].(string)
		left, ok2 := live[i+1].(string)
		ms, err := strconv.ParseInt(left, 10, 64)
		if !ok || !ok2 || err != nil || ms <= 0 {
			return bad("a live member without its time left")
		}
		l.Live = append(l.Live, Lease{URL: u, Left: time.Duration(ms) * time.Millisecond})
	}
	for _, g := range gone {
		u, ok := g.(string)
		if !ok {
			return bad("a tombstone that is not a string")
		}
		l.Gone = append(l.Gone, u)
	}
	sort.Slice(l.Live, func(i, j int) bool { return l.Live[i].URL < l.Live[j].URL })
	sort.Strings(l.Gone)
	return l, nil
}
