package gateway

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/redistest"
	"github.com/encgate/encgate/upstream"
)

// threeReplicas is one gateway as three replicas on one Redis, in front of
// the same encoders, and a client that sends every call to the next
// replica in turn, as a round-robin Service does.
type threeReplicas struct {
	t    *testing.T
	gws  [3]*gw
	next atomic.Uint64
	http *http.Client
}

func newThreeReplicas(t *testing.T, urls []string, mutate func(*Config)) *threeReplicas {
	t.Helper()
	rd := redistest.Start(t)
	r := &threeReplicas{t: t}
	for i := range r.gws {
		r.gws[i] = startGateway(t, urls, func(c *Config) {
			c.Idempotency.Store = "redis"
			c.Redis.Addr = rd.Addr()
			// A follow-up that waited for a pin it should have found would
			// hang past the client's guard: none may wait.
			c.Affinity.UnknownWait = configfile.Duration(time.Hour)
			c.Health.Disabled = true
			if mutate != nil {
				mutate(c)
			}
		})
	}
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	// The guard only catches a call that waits for a pin: unknown_wait is
	// an hour, and every call here is answered in milliseconds otherwise.
	r.http = &http.Client{Transport: tr, Timeout: 20 * time.Second}
	return r
}

// call sends one call to the next replica in turn (or to replica at, when
// at >= 0) and returns the status, the encoder that answered and the body.
func (r *threeReplicas) call(at int, route, body string) (int, string, string) {
	if at < 0 {
		at = int(r.next.Add(1) % 3)
	}
	resp, err := r.http.Post(r.gws[at].base+route, "application/json", strings.NewReader(body))
	if err != nil {
		r.t.Errorf("%s via replica %d: %v (a follow-up that waits for a pin never returns in time)", route, at, err)
		return 0, "", ""
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get("X-Encgate-Encoder"), string(b)
}

// follow makes a part's follow-ups, each on the next replica: the metadata
// pull and each of two ranks' /sends. Each must be answered 200 by the
// encoder its /encode was answered by.
func (r *threeReplicas) follow(id, encoder string) {
	calls := []struct{ route, body string }{
		{routeMetadata, metaBody(id)}, {routeSend, tpSend(id, 0, 2)}, {routeSend, tpSend(id, 1, 2)},
	}
	for _, c := range calls {
		if st, enc, body := r.call(-1, c.route, c.body); st != http.StatusOK || enc != encoder {
			r.t.Errorf("%s %s: %d from %q, want 200 from %q (its /encode's encoder): %s", c.route, id, st, enc, encoder, body)
		}
	}
}

// parts runs n parts, 20 at a time: each /encode on the next replica, then
// its follow-ups.
func (r *threeReplicas) parts(prefix string, n int) {
	sem := make(chan struct{}, 20)
	var wg sync.WaitGroup
	for i := range n {
		id := fmt.Sprintf("%s-%d_local_part_0", prefix, i)
		if r.t.Failed() {
			break // one part that failed says it; the rest would each wait the guard
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			st, enc, body := r.call(-1, routeEncode, encodeBody(id))
			if st != http.StatusOK {
				r.t.Errorf("/encode %s: %d %s", id, st, body)
				return
			}
			r.follow(id, enc)
		}()
	}
	wg.Wait()
}

// Three replicas act as one gateway: for 200 parts every follow-up lands
// on its /encode's encoder, and none waits affinity.unknown_wait, when the
// replicas would each place a part elsewhere.
func TestThreeReplicasActAsOne(t *testing.T) {
	const n = 200

	// Content affinity places by media under bounded load, which each
	// replica judges by its own pins: their choices differ.
	t.Run("content affinity", func(t *testing.T) {
		encs := startFakes(t, 3, nil)
		r := newThreeReplicas(t, fakeURLs(encs), func(c *Config) { c.Affinity.EncodeBy = upstream.EncodeByContent })
		r.parts("content", n)
	})

	// An /encode whose first encoder refuses the connection is re-pinned to
	// the next; follow-ups on the other replicas must follow the move, not
	// the rendezvous owner (the dead one).
	t.Run("re-pinned after a retryable failure", func(t *testing.T) {
		encs := startFakes(t, 3, nil)
		urls := append([]string{"http://" + deadAddr(t)}, fakeURLs(encs)...)
		r := newThreeReplicas(t, urls, func(c *Config) { c.Breaker.Disabled = true })
		// Only req_ids the dead encoder owns: each /encode is re-pinned.
		var ids []string
		for i := 0; len(ids) < n; i++ {
			id := fmt.Sprintf("moved-%d_local_part_0", i)
			if e, err := r.gws[0].Pool().Owner(id); err == nil && e.Name == "enc-0" {
				ids = append(ids, id)
			}
		}
		var wg sync.WaitGroup
		sem := make(chan struct{}, 20)
		for _, id := range ids {
			if t.Failed() {
				break
			}
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer func() { <-sem; wg.Done() }()
				st, enc, body := r.call(-1, routeEncode, encodeBody(id))
				if st != http.StatusOK || enc == "enc-0" {
					t.Errorf("/encode %s: %d from %q: %s", id, st, enc, body)
					return
				}
				r.follow(id, enc)
			}()
		}
		wg.Wait()
	})

	// One replica's breaker for enc-0 is open, the others' closed: parts the
	// others place on enc-0 have follow-ups on the first replica too.
	t.Run("breaker open on one replica only", func(t *testing.T) {
		encs := startFakes(t, 3, nil)
		r := newThreeReplicas(t, fakeURLs(encs), func(c *Config) {
			c.Breaker.BaseEjectionTime = configfile.Duration(time.Hour)
			c.Breaker.MaxEjectionTime = c.Breaker.BaseEjectionTime
		})
		e, ok := r.gws[0].Pool().Lookup("enc-0")
		if !ok {
			t.Fatal("no enc-0")
		}
		for e.Breaker.State() != upstream.BreakerOpen {
			done, ok := e.Breaker.Allow()
			if !ok {
				break
			}
			done(upstream.MarkFault)
		}
		if e.Breaker.State() != upstream.BreakerOpen {
			t.Fatalf("enc-0's breaker on replica 0 is %v", e.Breaker.State())
		}
		r.parts("breaker", n)
		if got := encs[0].Stats().Routes[routeEncode]; got == 0 {
			t.Fatal("no /encode reached enc-0: the case tried nothing")
		}
	})

	// The metadata pull reaches a replica before its /encode reaches
	// another: it waits for the pin, which the /encode's replica writes
	// when it places it, and is woken by it (not by unknown_wait).
	t.Run("metadata pull before its encode", func(t *testing.T) {
		encs := startFakes(t, 3, nil)
		r := newThreeReplicas(t, fakeURLs(encs), nil)
		const wave = 20
		for w := 0; w < n/wave && !t.Failed(); w++ {
			type pulled struct {
				st        int
				enc, body string
			}
			pulls := make([]chan pulled, wave)
			for i := range wave {
				id := fmt.Sprintf("early-%d-%d_local_part_0", w, i)
				pulls[i] = make(chan pulled, 1)
				go func() {
					st, enc, body := r.call((i+1)%3, routeMetadata, metaBody(id))
					pulls[i] <- pulled{st, enc, body}
				}()
			}
			// Every pull is waiting for its pin before any /encode goes.
			eventually(t, "the pulls waiting for their pins", func() bool {
				sum := 0
				for _, g := range r.gws {
					sum += g.Pool().PinWaiters()
				}
				return sum == wave
			})
			var wg sync.WaitGroup
			for i := range wave {
				id := fmt.Sprintf("early-%d-%d_local_part_0", w, i)
				wg.Add(1)
				go func() {
					defer wg.Done()
					st, enc, body := r.call(i%3, routeEncode, encodeBody(id))
					if st != http.StatusOK {
						t.Errorf("/encode %s: %d %s", id, st, body)
						return
					}
					p := <-pulls[i]
					if p.st != http.StatusOK || p.enc != enc {
						t.Errorf("early metadata pull %s: %d from %q, want 200 from %q: %s", id, p.st, p.enc, enc, p.body)
					}
					for rank := range 2 {
						if st, e, body := r.call(-1, routeSend, tpSend(id, rank, 2)); st != http.StatusOK || e != enc {
							t.Errorf("/send %s rank %d: %d from %q, want 200 from %q: %s", id, rank, st, e, enc, body)
						}
					}
				}()
			}
			wg.Wait()
		}
	})
}

// Without Redis the pins stay per process, as before: nothing of the
// share runs.
func TestPinsAreLocalWithoutRedis(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGatewayWith(t, fakeURLs(encs), nil, zap.NewNop())
	if g.stopPins != nil || g.kv != nil {
		t.Fatal("a memory-store gateway shares its pins")
	}
}
