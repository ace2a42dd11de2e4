package idempotency

import (
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/redistest"
)

// Receiver ranks that disagree on receive_count get what sglang NEW's
// note_send_done(req_id, receive_count, dest) gives them: each /send
// compares the distinct destinations counted so far (its own included)
// with its own receive_count; a /send without one is not counted. A
// destination after the release gets "already released", as from the
// encoder; before it, every rank is forwarded.
func TestRanksDisagreeingOnReceiveCountGetTheEncodersBehaviour(t *testing.T) {
	type step struct {
		receiveCount int
		want         Outcome
		released     bool
	}
	cases := map[string][]step{
		// The first /send's 2 kept (as before) would release at the
		// second rank and invent "already released" for the third.
		"2,3,3": {{2, Forwarded, false}, {3, Forwarded, false}, {3, Forwarded, true}},
		"1,2":   {{1, Forwarded, true}, {2, Released, false}},
		"4,2":   {{4, Forwarded, false}, {2, Forwarded, true}},
		"0,2,2": {{0, Forwarded, false}, {2, Forwarded, false}, {2, Forwarded, true}},
		"3,0,3": {{3, Forwarded, false}, {0, Forwarded, false}, {3, Forwarded, false}, {3, Forwarded, true}},
	}
	stores := map[string]func(t *testing.T) Store{
		"memory": func(*testing.T) Store { return NewMemory(1000, 1024, time.Hour, clock.NewFake(t0)) },
		"redis":  func(t *testing.T) Store { return newRedisStore(t, redistest.Start(t), redisOpts{}) },
	}
	for storeName, open := range stores {
		t.Run(storeName, func(t *testing.T) {
			st := open(t)
			s := NewSends(st, DefaultConfig(), clock.Real{}, zap.NewNop(), NewMetrics(prometheus.NewRegistry(), nil))
			fwd := func(time.Duration) (Answer, bool) { return okAnswer, true }
			for name, steps := range cases {
				for rank, step := range steps {
					req := Send{Key: NewKey("rc-"+name, "10.0.0.1", 40000+rank), ReceiveCount: step.receiveCount}
					res := s.Do(bg, req, time.Now().Add(hangGuard), fwd)
					if res.Outcome != step.want || res.Released != step.released {
						t.Errorf("%s: rank %d (receive_count %d): outcome %v released %v, want %v released %v",
							name, rank, step.receiveCount, res.Outcome, res.Released, step.want, step.released)
					}
				}
				// A repeat of a done rank replays, released or not.
				if res := s.Do(bg, Send{Key: NewKey("rc-"+name, "10.0.0.1", 40000)}, time.Now().Add(hangGuard), fwd); res.Outcome != Replayed {
					t.Errorf("%s: repeat of rank 0: %v", name, res.Outcome)
				}
			}
		})
	}
}

// Inspect shows the latest receive_count a /send carried.
func TestInspectShowsTheLatestReceiveCount(t *testing.T) {
	for name, st := range map[string]Store{
		"memory": NewMemory(1000, 1024, time.Hour, clock.NewFake(t0)),
		"redis":  newRedisStore(t, redistest.Start(t), redisOpts{}),
	} {
		for i, rc := range []int{4, 0, 6} {
			if _, err := st.Complete(bg, Key{"latest", fmt.Sprint(i)}, okRec(Fingerprint{}), rc); err != nil {
				t.Fatal(err)
			}
		}
		if v, err := st.Inspect(bg, "latest"); err != nil || v.ReceiveCount != 6 || v.Done != 3 || v.Released {
			t.Errorf("%s: Inspect = %+v, %v", name, v, err)
		}
	}
}
