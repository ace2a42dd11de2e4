package upstream

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/redisclient"
)

// PinShare is where the replicas of one gateway share their pins, so that
// a follow-up reaching any replica goes to the encoder its /encode's
// replica placed it on. PinTable keeps its own table as the fast path and
// asks the share only when it has no pin (and, for a pin another replica
// placed that is still pending, on a retry). RedisPins is the one
// implementation; each call is bounded by its own timeout.
type PinShare interface {
	// Place pins reqID to p (pending) unless a live pin that is pending
	// or encoded is there: then that pin is returned and placed is false.
	Place(reqID string, p Pin) (cur Pin, placed bool, err error)
	// Move re-pins a pin pending on from to p; false when it is not.
	Move(reqID string, from uint64, p Pin) (cur Pin, moved bool, err error)
	// Encoded marks a pin on id encoded.
	Encoded(reqID string, id uint64) error
	// Fail records a failure by PinTable.Fail's rules.
	Fail(reqID string, f Failure) error
	// Get reads reqID's pin.
	Get(reqID string) (Pin, bool, error)
	// Run delivers, until ctx ends, the req_ids newly placed anywhere to
	// placed (pub/sub; best effort: PinTable also polls while it waits).
	Run(ctx context.Context, placed func(reqID string))
	// Poll is how often a waiter re-reads the share.
	Poll() time.Duration
}

// RedisPins shares pins through Redis. One hash per req_id,
//
//	P{E}:pin   s (p pending, e encoded, f failed), e (encoder), id (its
//	           identity, decimal), a (answered, 0/1), st (status), m (message)
//	           PX affinity.pin_ttl, renewed by every write
//
// with E the req_id escaped as the /send store escapes it (idempotency's
// keys), so a req_id's pin and its /send records share one hash slot; and
// one channel, P pins:placed, on which every placement publishes its
// req_id. Each operation is one script (one round trip) that applies the
// same rule as PinTable's method of the same name, so the replicas agree
// on a pin's state as one process would.
type RedisPins struct {
	c       redis.UniversalClient
	log     *zap.Logger
	prefix  string
	channel string
	ttl     time.Duration
	timeout time.Duration
	poll    time.Duration
	errs    *prometheus.CounterVec
}

// NewRedisPins returns the share over c (the caller's), keys under prefix,
// pins living ttl, each operation bounded by timeout, waiters re-reading
// every poll. reg may be nil.
func NewRedisPins(c redis.UniversalClient, prefix string, ttl, timeout, poll time.Duration, log *zap.Logger, reg prometheus.Registerer) *RedisPins {
	if log == nil {
		log = zap.NewNop()
	}
	r := &RedisPins{c: c, log: log, prefix: prefix, channel: prefix + "pins:placed", ttl: ttl, timeout: timeout, poll: poll,
		errs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_pins_shared_errors_total",
			Help: "Operations on the pins shared through Redis that failed (Redis unreachable or slow); the replica then decided from its own table alone.",
		}, []string{"op"})}
	if reg != nil {
		r.errs = registerOrReuse(reg, r.errs)
	}
	return r
}

// registerOrReuse registers c, or returns the collector already registered
// under its name (a second pool on the same registry, in tests).
func registerOrReuse(reg prometheus.Registerer, c *prometheus.CounterVec) *prometheus.CounterVec {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if prev, ok := are.ExistingCollector.(*prometheus.CounterVec); ok {
				return prev
			}
		}
	}
	return c
}

// Poll implements PinShare.
func (r *RedisPins) Poll() time.Duration { return r.poll }

// key is P{E}:pin, E the req_id as redisclient.EscapeTag writes it (as
// the /send store's keys have it): one hash slot per req_id.
func (r *RedisPins) key(reqID string) string {
	return r.prefix + "{" + redisclient.EscapeTag(reqID) + "}:pin"
}

// pinScript applies one operation to the pin at KEYS[1] and returns
// {changed (0/1), the pin in force as a flat field list}.
//
// ARGV: op (place, move, encoded, fail), ttl ms, encoder, id, from id,
// answered, status, message, consequence, placed (0/1 each), channel,
// req_id.
var pinScript = redis.NewScript(`
local raw = redis.call('HGETALL', KEYS[1])
local c = {}
for i = 1, #raw, 2 do c[raw[i]] = raw[i + 1] end
local live = c.s ~= nil
local op = ARGV[1]
local function put(s, e, id, a, st, m)
  redis.call('HSET', KEYS[1], 's', s, 'e', e, 'id', id, 'a', a, 'st', st, 'm', m)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, {'s', s, 'e', e, 'id', id, 'a', a, 'st', st, 'm', m}}
end
if op == 'place' then
  if live and c.s ~= 'f' then return {0, raw} end
  local res = put('p', ARGV[3], ARGV[4], '0', '0', '')
  redis.call('PUBLISH', ARGV[11], ARGV[12])
  return res
elseif op == 'move' then
  if not live or c.s ~= 'p' or c.id ~= ARGV[5] then return {0, raw} end
  return put('p', ARGV[3], ARGV[4], '0', '0', '')
elseif op == 'encoded' then
  if not live or c.id ~= ARGV[4] or c.e == '' then return {0, raw} end
  return put('e', c.e, c.id, '0', '0', '')
elseif op == 'fail' then
  if (not live and ARGV[6] == '0') or
    (live and (c.s == 'e' or (c.s == 'f' and ARGV[9] == '1') or (c.s == 'p' and ARGV[6] == '0' and ARGV[10] == '0'))) then
    return {0, raw}
  end
  local res = put('f', c.e or ARGV[3], c.id or ARGV[4], ARGV[6], ARGV[7], ARGV[8])
  if not live then redis.call('PUBLISH', ARGV[11], ARGV[12]) end
  return res
end
return redis.error_reply('unknown op ' .. op)
`)

func b01(b bool) string {
	if b {
		return "1"
	}
	return "0"
}

func (r *RedisPins) run(op, reqID string, p Pin, from uint64, f Failure) (Pin, bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), r.timeout)
	defer cancel()
	res, err := pinScript.Run(ctx, r.c, []string{r.key(reqID)},
		op, r.ttl.Milliseconds(), p.Encoder, strconv.FormatUint(p.EncoderID, 10), strconv.FormatUint(from, 10),
		b01(f.Answered), f.Status, f.Message, b01(f.Consequence), b01(f.Placed), r.channel, reqID).Slice()
	if err != nil {
		r.errs.WithLabelValues(op).Inc()
		return Pin{}, false, fmt.Errorf("redis pin %s: %w", op, err)
	}
	if len(res) != 2 {
		return Pin{}, false, fmt.Errorf("redis pin %s: unexpected reply %v", op, res)
	}
	changed, _ := res[0].(int64)
	fields, _ := res[1].([]any)
	cur, _, err := decodePin(fields)
	return cur, changed == 1, err
}

// Place implements PinShare.
func (r *RedisPins) Place(reqID string, p Pin) (Pin, bool, error) {
	return r.run("place", reqID, p, 0, Failure{})
}

// Move implements PinShare.
func (r *RedisPins) Move(reqID string, from uint64, p Pin) (Pin, bool, error) {
	return r.run("move", reqID, p, from, Failure{})
}

// Encoded implements PinShare.
func (r *RedisPins) Encoded(reqID string, id uint64) error {
	_, _, err := r.run("encoded", reqID, Pin{EncoderID: id}, 0, Failure{})
	return err
}

// Fail implements PinShare.
func (r *RedisPins) Fail(reqID string, f Failure) error {
	_, _, err := r.run("fail", reqID, Pin{Encoder: f.Encoder, EncoderID: f.EncoderID}, 0, f)
	return err
}

// Get implements PinShare.
func (r *RedisPins) Get(reqID string) (Pin, bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), r.timeout)
	defer cancel()
	m, err := r.c.HGetAll(ctx, r.key(reqID)).Result()
	if err != nil {
		r.errs.WithLabelValues("get").Inc()
		return Pin{}, false, fmt.Errorf("redis pin get: %w", err)
	}
	if len(m) == 0 {
		return Pin{}, false, nil
	}
	flat := make([]any, 0, 2*len(m))
	for k, v := range m {
		flat = append(flat, k, v)
	}
	return decodePin(flat)
}

// decodePin reads a pin's flat field list; ok is false for an empty one.
func decodePin(fields []any) (Pin, bool, error) {
	if len(fields) == 0 {
		return Pin{}, false, nil
	}
	var p Pin
	for i := 0; i+1 < len(fields); i += 2 {
		k, _ := fields[i].(string)
		v, _ := fields[i+1].(string)
		var err error
		switch k {
		case "s":
			switch v {
			case "p":
				p.State = PinPending
			case "e":
				p.State = PinEncoded
			case "f":
				p.State = PinFailed
			default:
				return Pin{}, false, fmt.Errorf("redis pin: state %q", v)
			}
		case "e":
			p.Encoder = v
		case "id":
			p.EncoderID, err = strconv.ParseUint(v, 10, 64)
		case "a":
			p.Answered = v == "1"
		case "st":
			p.Status, err = strconv.Atoi(v)
		case "m":
			p.Message = v
		}
		if err != nil {
			return Pin{}, false, fmt.Errorf("redis pin: field %s: %w", k, err)
		}
	}
	return p, true, nil
}

// Run implements PinShare: one subscription to the placement channel,
// which go-redis re-makes after a reconnect (a failover included).
func (r *RedisPins) Run(ctx context.Context, placed func(reqID string)) {
	ps := r.c.Subscribe(ctx, r.channel)
	var once sync.Once
	stop := func() { once.Do(func() { _ = ps.Close() }) }
	defer stop()
	go func() { <-ctx.Done(); stop() }()
	ch := ps.Channel(redis.WithChannelSize(1024))
	for {
		select {
		case <-ctx.Done():
			return
		case m, ok := <-ch:
			if !ok {
				return
			}
			placed(m.Payload)
		}
	}
}
