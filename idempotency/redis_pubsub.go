package idempotency

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// startHub starts the pub/sub reader on first use.
func (r *Redis) startHub() (*redisHub, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, &unavailableError{op: "await", err: redis.ErrClosed}
	}
	if r.hub == nil {
		r.hub = newRedisHub(r.c, r.opTimeout, r.log)
	}
	return r.hub, nil
}

// publishedRecord starts a done-channel message that carries the holder's
// record (encodeRecord) rather than only saying the claim ended.
const publishedRecord = "r"

// redisHub shares one pub/sub connection among the waiters of a Redis.
type redisHub struct {
	ps      *redis.PubSub
	log     *zap.Logger
	timeout time.Duration

	mu         sync.Mutex // protects waiters and subscribed
	waiters    map[string]map[*redisWaiter]struct{}
	subscribed map[string]bool // channels asked of go-redis

	kick chan struct{} // the waiter set changed
	stop chan struct{}
	wg   sync.WaitGroup
}

type redisWaiter struct {
	channel   string
	wake      chan struct{}          // capacity 1: something may have changed
	published atomic.Pointer[string] // the holder's record, published while Redis refuses to store it
}

func newRedisHub(c redis.UniversalClient, timeout time.Duration, log *zap.Logger) *redisHub {
	h := &redisHub{
		ps:         c.Subscribe(context.Background()),
		log:        log,
		timeout:    timeout,
		waiters:    make(map[string]map[*redisWaiter]struct{}),
		subscribed: make(map[string]bool),
		kick:       make(chan struct{}, 1),
		stop:       make(chan struct{}),
	}
	msgs := h.ps.ChannelWithSubscriptions(redis.WithChannelSize(1024))
	h.wg.Add(2)
	go h.read(msgs)
	go h.subscriber()
	return h
}

// read dispatches messages and subscription confirmations to the waiters
// of their channel until the PubSub is closed.
func (h *redisHub) read(msgs <-chan any) {
	defer h.wg.Done()
	for m := range msgs {
		var ch string
		var rec *string
		switch m := m.(type) {
		case *redis.Message:
			ch = m.Channel
			if p, ok := strings.CutPrefix(m.Payload, publishedRecord); ok {
				rec = &p
			}
		case *redis.Subscription:
			if m.Kind != "subscribe" {
				continue
			}
			ch = m.Channel
		default:
			continue
		}
		h.mu.Lock()
		for w := range h.waiters[ch] {
			if rec != nil {
				w.published.Store(rec)
			}
			select {
			case w.wake <- struct{}{}:
			default:
			}
		}
		h.mu.Unlock()
	}
}

// subscriber brings go-redis's channel set in line with the waiters. It is
// the only goroutine that subscribes or unsubscribes, so those happen in
// order, and waiters never wait on them. go-redis keeps the channels it was
// asked for and subscribes them again after a reconnect, even when the call
// here failed.
func (h *redisHub) subscriber() {
	defer h.wg.Done()
	for {
		select {
		case <-h.stop:
			return
		case <-h.kick:
		}
		var sub, unsub []string
		h.mu.Lock()
		for ch := range h.waiters {
			if !h.subscribed[ch] {
				h.subscribed[ch] = true
				sub = append(sub, ch)
			}
		}
		for ch := range h.subscribed {
			if _, ok := h.waiters[ch]; !ok {
				delete(h.subscribed, ch)
				unsub = append(unsub, ch)
			}
		}
		h.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), h.timeout)
		if len(unsub) > 0 {
			if err := h.ps.Unsubscribe(ctx, unsub...); err != nil {
				h.log.Debug("redis unsubscribe failed", zap.Int("channels", len(unsub)), zap.Error(err))
			}
		}
		if len(sub) > 0 {
			if err := h.ps.Subscribe(ctx, sub...); err != nil {
				h.log.Debug("redis subscribe failed; waiters poll until it reconnects",
					zap.Int("channels", len(sub)), zap.Error(err))
			}
		}
		cancel()
	}
}

func (h *redisHub) add(channel string) *redisWaiter {
	w := &redisWaiter{channel: channel, wake: make(chan struct{}, 1)}
	h.mu.Lock()
	ws := h.waiters[channel]
	if ws == nil {
		ws = make(map[*redisWaiter]struct{})
		h.waiters[channel] = ws
	}
	ws[w] = struct{}{}
	first := len(ws) == 1 && !h.subscribed[channel]
	h.mu.Unlock()
	if first {
		h.nudge()
	}
	return w
}

func (h *redisHub) remove(w *redisWaiter) {
	h.mu.Lock()
	ws := h.waiters[w.channel]
	delete(ws, w)
	last := len(ws) == 0
	if last {
		delete(h.waiters, w.channel)
	}
	h.mu.Unlock()
	if last {
		h.nudge()
	}
}

func (h *redisHub) nudge() {
	select {
	case h.kick <- struct{}{}:
	default:
	}
}

func (h *redisHub) close() {
	close(h.stop)
	_ = h.ps.Close()
	h.wg.Wait()
}
