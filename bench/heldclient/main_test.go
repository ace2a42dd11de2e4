package main

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestRankIsNearestRank(t *testing.T) {
	xs := make([]float64, 100)
	for i := range xs {
		xs[i] = float64(i + 1)
	}
	for _, c := range []struct {
		q    float64
		want float64
	}{{0.50, 50}, {0.99, 99}, {1, 100}, {0, 1}} {
		if got := rank(xs, c.q); got != c.want {
			t.Errorf("rank(1..100, %v) = %v, want %v", c.q, got, c.want)
		}
	}
	if got := rank([]float64{7}, 0.99); got != 7 {
		t.Errorf("rank([7], 0.99) = %v, want 7", got)
	}
}

// encodeFake answers /encode 200 and calls seen with each req_id, in the
// order they came.
func encodeFake(t *testing.T, seen func(id string)) string {
	t.Helper()
	fake := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var m struct {
			ReqID string `json:"req_id"`
		}
		if r.URL.Path != "/encode" || json.NewDecoder(r.Body).Decode(&m) != nil {
			http.Error(w, "bad", http.StatusBadRequest)
			return
		}
		seen(m.ReqID)
	}))
	t.Cleanup(fake.Close)
	return strings.TrimPrefix(fake.URL, "http://")
}

func pulls(n int) []chan struct{} {
	done := make([]chan struct{}, n)
	for i := range done {
		done[i] = make(chan struct{})
	}
	return done
}

// One worker posts the req_ids in order, each once its previous pull was
// answered, and records when each was sent.
func TestReleaseEachPostsInOrderAndTimesEach(t *testing.T) {
	const n = 5
	done := pulls(n)
	var mu sync.Mutex
	var order []string
	addr := encodeFake(t, func(id string) {
		mu.Lock()
		defer mu.Unlock()
		close(done[len(order)]) // this pull's answer, as the proxy would deliver it
		order = append(order, id)
	})

	sent := releaseEach(addr, n, 1, "p-", 1, time.Now().Add(time.Minute), done)

	if want := "p-0 p-1 p-2 p-3 p-4"; strings.Join(order, " ") != want {
		t.Errorf("order %q, want %q", strings.Join(order, " "), want)
	}
	for i, s := range sent {
		if s.IsZero() {
			t.Errorf("sent[%d] not recorded", i)
		}
		if i > 0 && s.Before(sent[i-1]) {
			t.Errorf("sent[%d] %v before sent[%d] %v", i, s, i-1, sent[i-1])
		}
	}
}

// A pull never answered holds its worker: with one worker nothing more is
// posted, and the release ends at the readers' deadline (already past here).
func TestReleaseEachWaitsForThePullBeforeTheNext(t *testing.T) {
	const n = 4
	done := pulls(n) // none is ever answered
	var mu sync.Mutex
	var order []string
	addr := encodeFake(t, func(id string) {
		mu.Lock()
		defer mu.Unlock()
		order = append(order, id)
	})

	sent := releaseEach(addr, n, 1, "p-", 1, time.Now(), done)

	if strings.Join(order, " ") != "p-0" {
		t.Errorf("posted %v, want only p-0 while its pull is unanswered", order)
	}
	for i := 1; i < n; i++ {
		if !sent[i].IsZero() {
			t.Errorf("sent[%d] recorded for a req_id never posted", i)
		}
	}
}

// Two workers: with no pull answered, exactly two are posted (one each).
func TestReleaseEachBoundsTheOutstandingPulls(t *testing.T) {
	const n = 6
	done := pulls(n)
	var mu sync.Mutex
	var order []string
	addr := encodeFake(t, func(id string) {
		mu.Lock()
		defer mu.Unlock()
		order = append(order, id)
	})

	releaseEach(addr, n, 1, "p-", 2, time.Now(), done)

	if len(order) != 2 {
		t.Errorf("posted %v with no pull answered, want two (one per worker)", order)
	}
}

func TestReportLatencyCountsOnlyReleasedOkAnswers(t *testing.T) {
	t0 := time.Unix(1000, 0)
	answers := []answer{
		{kind: "ok", at: t0.Add(100 * time.Microsecond)},
		{kind: "ok", at: t0.Add(300 * time.Microsecond)},
		{kind: "wrong", at: t0.Add(time.Second)},
		{kind: "ok", early: true, at: t0.Add(time.Second)},
		{kind: "ok", at: t0.Add(time.Second)}, // never sent
	}
	sent := []time.Time{t0, t0, t0, t0, {}}
	if got := latencies(answers, sent); len(got) != 2 || got[0] != 100 || got[1] != 300 {
		t.Errorf("latencies = %v, want [100 300]", got)
	}
}

// With tp pulls per req_id, each req_id's /encode is posted once, the next
// only once all its pulls were answered, and each pull is timed from its
// req_id's /encode.
func TestReleaseEachPostsOncePerPartAndWaitsForItsRanks(t *testing.T) {
	const n, tp = 6, 3
	done := pulls(n)
	var mu sync.Mutex
	var order []string
	addr := encodeFake(t, func(id string) {
		mu.Lock()
		defer mu.Unlock()
		part := len(order)
		order = append(order, id)
		if part == 0 {
			for k := 0; k < tp; k++ { // the first part's ranks are answered
				close(done[k])
			}
		}
	})

	sent := releaseEach(addr, n, tp, "p-", 1, time.Now().Add(200*time.Millisecond), done)

	if got := strings.Join(order, " "); got != "p-0 p-1" {
		t.Fatalf("posted %q, want p-0 then p-1, each once", got)
	}
	for k := 1; k < n; k++ {
		if want := sent[k/tp*tp]; !sent[k].Equal(want) || sent[k].IsZero() {
			t.Fatalf("pull %d timed from %v, want its part's /encode at %v", k, sent[k], want)
		}
	}
}
