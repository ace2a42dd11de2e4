package idempotency

import (
	"errors"
	"time"

	"go.uber.org/zap"
)

// HealthPingInterval is how often a Redis store that has heard nothing
// from Redis for that long asks it (PING): the state of an idle store stays
// at most this old, and a busy one, whose own calls say how Redis is, sends
// none. One PING per interval per replica, whatever the traffic.
const HealthPingInterval = 5 * time.Second

// Health is what a store has learned of its backend from its own calls.
type Health struct {
	// Up is true while the last call the store made (or its PING) was
	// answered; false once one failed (unreachable, timed out, refused:
	// every error that is ErrUnavailable), until one is answered again.
	Up bool
	// Since is when Up took its value.
	Since time.Time
	// Err is the failure that made it down; nil while up.
	Err error
}

// HealthReporter is a store that can say how its backend is: the Redis
// store. A store that is not one (memory) has no backend to lose.
type HealthReporter interface {
	Health() Health
}

var _ HealthReporter = (*Redis)(nil)

// errNotContacted is the state of a store that has made no call yet.
var errNotContacted = errors.New("redis not contacted yet")

// Health implements HealthReporter.
func (r *Redis) Health() Health {
	r.hmu.Lock()
	defer r.hmu.Unlock()
	return r.health
}

// noteHealth records the result of a call to Redis: err nil when it was
// answered, else the store's error for it. Callers leave out what says
// nothing of Redis: the caller's own context ending, the store closing.
// Each change after the first is logged once.
func (r *Redis) noteHealth(err error) {
	now := r.clk.Now()
	r.hmu.Lock()
	r.seen = now
	was := r.health
	changed := was.Up != (err == nil)
	if changed {
		r.health.Since = now
	}
	r.health.Up, r.health.Err = err == nil, err
	r.hmu.Unlock()
	switch {
	case !changed, errors.Is(was.Err, errNotContacted): // Open logs the first check
	case err == nil:
		r.log.Info("redis answers the /send store again", zap.Duration("down_for", now.Sub(was.Since)))
	case err != nil:
		r.log.Warn("the /send store cannot reach redis: /sends are refused (forwarded without dedupe with idempotency.fail_open) until it answers",
			zap.Error(err))
	}
}

// startHealth starts the PING that keeps an idle store's Health fresh
// (HealthPingInterval; Open starts it). It stops with Close.
func (r *Redis) startHealth(interval time.Duration) {
	r.bg.Add(1)
	go r.watchHealth(interval)
}

// watchHealth wakes every interval on the store's clock and pings Redis
// when no call has had a result since the interval began.
func (r *Redis) watchHealth(interval time.Duration) {
	defer r.bg.Done()
	for {
		t := r.clk.NewTimer(interval)
		select {
		case <-r.done:
			t.Stop()
			return
		case <-t.C():
		}
		r.hmu.Lock()
		idle := r.clk.Now().Sub(r.seen) >= interval
		r.hmu.Unlock()
		if idle {
			_ = r.Ping(r.life) // noteHealth records its result
		}
	}
}
