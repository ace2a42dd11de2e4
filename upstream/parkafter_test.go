package upstream

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
)

// A parkable attempt parks only when its answer has not begun within
// Deps.ParkAfter: one that comes at once is read on the caller's
// goroutine (the call ends there), one the encoder holds parks, and a
// negative ParkAfter parks every attempt.
func TestParkAfter(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if strings.Contains(string(b), "held") {
			<-release
		}
		fmt.Fprint(w, `{"req_id":"r_local_part_0","part_idx":0,"embedding_size":8,"embedding_len":1,"embedding_dim":2}`)
	}))
	t.Cleanup(srv.Close)
	pool := func(after time.Duration) *Pool {
		aff := DefaultAffinity()
		aff.UnknownWait = 0
		aff.MetadataCache = 0
		p, err := NewPool(testSettings("e", srv.URL), aff, Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry(),
			Clock: clock.NewFake(time.Unix(1e9, 0)), Rand: func() float64 { return 0 }, Park: true, ParkAfter: after})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		if p.poller == nil {
			t.Skip("no poller here: nothing parks")
		}
		return p
	}
	exchange := func(p *Pool, id string, unblock func()) (res Result, ended bool) {
		c := pullCall(id, 0)
		done := make(chan Result, 1)
		res, ended = p.ExchangeParked(c, func(r Result) { done <- r })
		if !ended {
			unblock()
			res = <-done
		}
		if res.Verdict.Status != http.StatusOK {
			t.Fatalf("%s: status %d, want 200", id, res.Verdict.Status)
		}
		return res, ended
	}
	t.Run("an answer within ParkAfter", func(t *testing.T) {
		if _, ended := exchange(pool(time.Hour), "r_local_part_0", func() {}); !ended {
			t.Fatal("a pull answered at once parked with an hour to wait")
		}
	})
	t.Run("an answer the encoder holds", func(t *testing.T) {
		if _, ended := exchange(pool(time.Millisecond), "held_local_part_0", func() { close(release) }); ended {
			t.Fatal("a held pull ended without parking")
		}
	})
	t.Run("negative", func(t *testing.T) {
		if _, ended := exchange(pool(-1), "r_local_part_0", func() {}); ended {
			t.Fatal("ParkAfter < 0: the pull ended without parking")
		}
	})
}
