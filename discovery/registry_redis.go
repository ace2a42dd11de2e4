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
const registryKeySuffix = "bootstrap:encoders"

// registryKeyGrace is how long the key outlives its latest expiry. The key's
// own expiry is relative (PEXPIRE), so a clock difference between the
// gateways and Redis cannot remove it early; it only keeps an abandoned key
// from staying forever.
const registryKeyGrace = 60 * time.Second

// registryAddScript drops expired members, refuses a new URL when ARGV[4] are
// stored, and adds or refreshes the URL, in one step so that replicas
// cannot both pass the bound. It returns 1 when stored, 0 when full.
//
// KEYS[1] the set; ARGV[1] url, ARGV[2] now (unix ms), ARGV[3] expiry (unix
// ms), ARGV[4] max, ARGV[5] key grace (ms).
var registryAddScript = redis.NewScript(`
local now = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then
    return 0
  end
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
local top = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local ttl = tonumber(top[2]) - now
if ttl < 1 then ttl = 1 end
redis.call('PEXPIRE', KEYS[1], ttl + tonumber(ARGV[5]))
return 1
`)

// registryExtendScript moves the expiry of the given URLs that are stored and
// unexpired, and only those, so a refresh cannot resurrect a URL another
// replica just removed. It returns how many it moved.
//
// KEYS[1] the set; ARGV[1] now (unix ms), ARGV[2] expiry (unix ms), ARGV[3]
// key grace (ms), ARGV[4...] the URLs.
var registryExtendScript = redis.NewScript(`
local now = tonumber(ARGV[1])
local exp = tonumber(ARGV[2])
local n = 0
for i = 4, #ARGV do
  local s = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if s and tonumber(s) > now and tonumber(s) < exp then
    redis.call('ZADD', KEYS[1], ARGV[2], ARGV[i])
    n = n + 1
  end
end
if n > 0 then
  local top = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  local ttl = tonumber(top[2]) - now
  if ttl < 1 then ttl = 1 end
  redis.call('PEXPIRE', KEYS[1], ttl + tonumber(ARGV[3]))
end
return n
`)

// NewRedisStore returns a Store shared by every gateway replica using
// client and prefix, so a registration on one is seen by all. It keeps one
// sorted set, prefix+"bootstrap:encoders": member = URL, score = expiry in
// unix milliseconds. Expiry times come from the replicas' clocks (passed to
// every call), so replicas should keep their clocks in step to within a
// small part of the TTL.
func NewRedisStore(client redis.UniversalClient, prefix string) Store {
	return &redisStore{c: client, key: prefix + registryKeySuffix}
}

// redisStore is the Redis Store.
type redisStore struct {
	c   redis.UniversalClient
	key string
}

func unixMilli(t time.Time) string { return strconv.FormatInt(t.UnixMilli(), 10) }

func (s *redisStore) Add(ctx context.Context, url string, now, expires time.Time, max int) error {
	n, err := registryAddScript.Run(ctx, s.c, []string{s.key},
		url, unixMilli(now), unixMilli(expires), max, registryKeyGrace.Milliseconds()).Int()
	if err != nil {
		return fmt.Errorf("redis: %w", err)
	}
	if n == 0 {
		return ErrFull
	}
	return nil
}

func (s *redisStore) Extend(ctx context.Context, urls []string, now, expires time.Time) error {
	if len(urls) == 0 {
		return nil
	}
	args := make([]any, 0, 3+len(urls))
	args = append(args, unixMilli(now), unixMilli(expires), registryKeyGrace.Milliseconds())
	for _, u := range urls {
		args = append(args, u)
	}
	if err := registryExtendScript.Run(ctx, s.c, []string{s.key}, args...).Err(); err != nil {
		return fmt.Errorf("redis: %w", err)
	}
	return nil
}

func (s *redisStore) Remove(ctx context.Context, url string) error {
	if err := s.c.ZRem(ctx, s.key, url).Err(); err != nil {
		return fmt.Errorf("redis: %w", err)
	}
	return nil
}

func (s *redisStore) List(ctx context.Context, now time.Time) ([]string, error) {
	urls, err := s.c.ZRangeByScore(ctx, s.key, &redis.ZRangeBy{Min: "(" + unixMilli(now), Max: "+inf"}).Result()
	if err != nil {
		return nil, fmt.Errorf("redis: %w", err)
	}
	sort.Strings(urls)
	return urls, nil
}
