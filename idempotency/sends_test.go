package idempotency

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
)

func newSends(t *testing.T) (*Sends, *Memory, *clock.Fake, *prometheus.Registry) {
	t.Helper()
	clk := clock.NewFake(t0)
	mem := NewMemory(1000, 1024, time.Minute, clk)
	reg := prometheus.NewRegistry()
	return NewSends(mem, DefaultConfig(), clk, zap.NewNop(), NewMetrics(reg, mem)), mem, clk, reg
}

func sendReq(dest string, fp Fingerprint, n int) Send {
	return Send{Key: Key{ReqID: "r", Dest: dest}, FP: fp, ReceiveCount: n}
}

var okAnswer = Answer{200, "application/json", []byte("null"), "enc-0"}

func TestSendsCoalesceThenReplay(t *testing.T) {
	s, _, clk, reg := newSends(t)
	const n = 64
	release := make(chan struct{})
	var forwards atomic.Int32
	forward := func(time.Duration) (Answer, bool) {
		forwards.Add(1)
		<-release
		return okAnswer, true
	}
	results := make(chan Result, n)
	var started sync.WaitGroup
	started.Add(1)
	go func() {
		started.Done()
		results <- s.Do(bg, sendReq("h:1", Fingerprint{1, 2}, 0), clk.Now().Add(time.Hour), forward)
	}()
	started.Wait()
	// Wait until the leader is inside forward, then add the duplicates.
	for forwards.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	var wg sync.WaitGroup
	for i := 1; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results <- s.Do(bg, sendReq("h:1", Fingerprint{1, 2}, 0), clk.Now().Add(time.Hour), forward)
		}()
	}
	for len(s.Inflight("r")) != 1 || clk.Pending() < n-1 {
		time.Sleep(time.Millisecond) // every duplicate is parked on its deadline timer
	}
	close(release)
	wg.Wait()
	count := map[Outcome]int{}
	for i := 0; i < n; i++ {
		r := <-results
		count[r.Outcome]++
		if r.Answer.Status != 200 || string(r.Answer.Body) != "null" {
			t.Fatalf("answer %+v", r.Answer)
		}
	}
	if forwards.Load() != 1 || count[Forwarded] != 1 || count[Inflight] != n-1 {
		t.Fatalf("forwards %d, outcomes %v", forwards.Load(), count)
	}
	r := s.Do(bg, sendReq("h:1", Fingerprint{1, 2}, 0), clk.Now().Add(time.Hour), forward)
	if r.Outcome != Replayed || forwards.Load() != 1 {
		t.Fatalf("later duplicate: %v, forwards %d", r.Outcome, forwards.Load())
	}
	if got := testutil.ToFloat64(s.m.inflight); got != n-1 {
		t.Errorf("inflight metric %v", got)
	}
	if got := testutil.ToFloat64(s.m.replay); got != 1 {
		t.Errorf("replay metric %v", got)
	}
	_ = reg
}

func TestSendsWaiterLeavesAtItsDeadline(t *testing.T) {
	s, _, clk, _ := newSends(t)
	release := make(chan struct{})
	entered := make(chan struct{})
	leader := make(chan Result, 1)
	go func() {
		leader <- s.Do(bg, sendReq("h:1", Fingerprint{}, 0), clk.Now().Add(time.Hour), func(time.Duration) (Answer, bool) {
			close(entered)
			<-release
			return okAnswer, true
		})
	}()
	<-entered
	created := clk.TimerCreated()
	waiter := make(chan Result, 1)
	go func() {
		waiter <- s.Do(bg, sendReq("h:1", Fingerprint{}, 0), clk.Now().Add(time.Second), nil)
	}()
	<-created
	clk.Advance(time.Second)
	if r := <-waiter; r.Outcome != WaitTimeout {
		t.Fatalf("waiter outcome %v", r.Outcome)
	}
	close(release) // the leader was not disturbed
	if r := <-leader; r.Outcome != Forwarded {
		t.Fatalf("leader outcome %v", r.Outcome)
	}
}

func TestSendsConflict(t *testing.T) {
	s, _, clk, _ := newSends(t)
	fwd := func(time.Duration) (Answer, bool) { return okAnswer, true }
	s.Do(bg, sendReq("h:1", Fingerprint{1, 2}, 0), clk.Now().Add(time.Hour), fwd)
	r := s.Do(bg, sendReq("h:1", Fingerprint{1, 3}, 0), clk.Now().Add(time.Hour), fwd)
	if r.Outcome != Conflict || r.Field != "buffer_address" {
		t.Fatalf("%+v", r)
	}
	r = s.Do(bg, sendReq("h:1", Fingerprint{9, 2}, 0), clk.Now().Add(time.Hour), fwd)
	if r.Outcome != Conflict || r.Field != "session_id" {
		t.Fatalf("%+v", r)
	}
}

func TestSendsUndeliveredIsNotStored(t *testing.T) {
	s, mem, clk, _ := newSends(t)
	calls := 0
	fwd := func(time.Duration) (Answer, bool) {
		calls++
		return Answer{502, "application/json", []byte(`{"status":"error"}`), "enc-0"}, calls > 1
	}
	if r := s.Do(bg, sendReq("h:1", Fingerprint{}, 0), clk.Now().Add(time.Hour), fwd); r.Outcome != Forwarded || r.Answer.Status != 502 {
		t.Fatalf("%+v", r)
	}
	if mem.Records() != 0 {
		t.Fatal("undelivered answer was stored")
	}
	if r := s.Do(bg, sendReq("h:1", Fingerprint{}, 0), clk.Now().Add(time.Hour), fwd); r.Outcome != Forwarded || calls != 2 {
		t.Fatalf("retry after undelivered: %+v calls %d", r, calls)
	}
}

func TestSendsReleaseAfterReceiveCount(t *testing.T) {
	s, _, clk, _ := newSends(t)
	fwd := func(time.Duration) (Answer, bool) { return okAnswer, true }
	dests := []string{"h:1", "h:2", "h:3", "h:4"}
	for i, d := range dests {
		r := s.Do(bg, sendReq(d, Fingerprint{}, 4), clk.Now().Add(time.Hour), fwd)
		if r.Outcome != Forwarded || r.Released != (i == 3) {
			t.Fatalf("dest %s: %+v", d, r)
		}
	}
	if r := s.Do(bg, sendReq("h:5", Fingerprint{}, 4), clk.Now().Add(time.Hour), fwd); r.Outcome != Released {
		t.Fatalf("fifth destination: %v", r.Outcome)
	}
	if r := s.Do(bg, sendReq("h:2", Fingerprint{}, 4), clk.Now().Add(time.Hour), fwd); r.Outcome != Replayed {
		t.Fatalf("done destination after release: %v", r.Outcome)
	}
}
